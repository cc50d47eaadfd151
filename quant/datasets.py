"""Data sets for training and evaluation, all letterboxed by the agent's one letterbox.

Every image is letterboxed to the training tier with :func:`agent.pipeline.preprocess.letterbox` and kept as uint8 BGR,
exactly what the box produces from a camera frame; :func:`network_input` then applies the bundle's colour
order and normalisation through :class:`agent.pipeline.input_batch.BatchPreprocessor`. So training, calibration, golden
sets and the box share one preprocessing definition.

Sources: an ImageFolder tree (``root/<class>/*.jpg``), a YOLO-format tree (``images/`` + ``labels/*.txt``),
scikit-learn's digits (real 8x8 scans, no download) and generated shapes scenes (:mod:`agent.devtools.scenes`). Every
problem with the input is raised as :class:`DatasetError` naming the file or field, before training.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

from agent.devtools.scenes import SHAPE_LABELS, generate_scene
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.preprocess import PreprocessSpec, letterbox_for

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
# Aspect ratios (h, w) of generated shapes scenes: square, 4:3, 16:9 and portrait, so every tier sees
# letterbox padding on some side. The long side is drawn from SHAPES_LONG_SIDE.
SHAPES_ASPECTS = ((1, 1), (3, 4), (9, 16), (4, 3))
SHAPES_LONG_SIDE = (320, 480)


class DatasetError(ValueError):
    """Bad input data: the message names the file, directory or field."""


@dataclass
class ImageSet:
    """Letterboxed images at one tier with their ground truth (input-pixel coordinates for boxes)."""

    images: np.ndarray  # (N, H, W, 3) uint8 BGR, letterboxed
    sources: List[str]  # where each image came from (file path or "digits[17]")
    labels: Optional[np.ndarray] = None  # classification: (N,) int64
    boxes: List[np.ndarray] = field(default_factory=list)  # detection: N x (k, 4) float32 x1, y1, x2, y2
    classes: List[np.ndarray] = field(default_factory=list)  # detection: N x (k,) int64

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, indices: Sequence[int]) -> "ImageSet":
        idx = list(indices)
        return ImageSet(
            images=self.images[idx],
            sources=[self.sources[i] for i in idx],
            labels=None if self.labels is None else self.labels[idx],
            boxes=[self.boxes[i] for i in idx] if self.boxes else [],
            classes=[self.classes[i] for i in idx] if self.classes else [],
        )


# Held-out images kept at their original size for golden sets (letterboxed later to every tier).
GOLDEN_ORIGINALS = 16


@dataclass
class SplitData:
    train: ImageSet
    test: ImageSet
    labels: List[str]
    originals: List[np.ndarray] = field(default_factory=list)  # first test images, uint8 BGR, original size


def read_image(path: str) -> np.ndarray:
    """Decode an image file to uint8 BGR; a file OpenCV cannot decode is a DatasetError naming it."""
    data = np.fromfile(path, dtype=np.uint8)
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise DatasetError("%s: not a decodable image" % path)
    return image


def _letterbox_into(
    image_bgr: np.ndarray, tier_hw: Tuple[int, int], spec: PreprocessSpec
) -> Tuple[np.ndarray, float, int, int]:
    """Letterbox with the bundle's options; returns the image, the gain and the left/top padding."""
    boxed, plan = letterbox_for(image_bgr, tier_hw, spec)
    return boxed, plan.gain, plan.left, plan.top


def _map_boxes(boxes_xyxy: np.ndarray, gain: float, left: int, top: int) -> np.ndarray:
    """Source pixels -> input pixels, the inverse of :func:`agent.pipeline.preprocess.scale_boxes`."""
    return (boxes_xyxy * gain + np.array([left, top, left, top], np.float32)).astype(np.float32)


def network_input(images_bgr: np.ndarray, spec: PreprocessSpec, layout: str = "NCHW") -> np.ndarray:
    """Letterboxed uint8 BGR (N, H, W, 3) -> float32 network input in the spec's colour order and
    normalisation."""
    count, height, width, _ = images_bgr.shape
    batcher = BatchPreprocessor(spec, (height, width), max_batch=count, input_layout=layout)
    for i in range(count):
        batcher.fill_letterboxed(i, images_bgr[i])
    return batcher.batch.copy()


def split_indices(count: int, test_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """A fixed shuffled split: the same seed always gives the same train/test partition."""
    order = np.random.default_rng(seed).permutation(count)
    n_test = max(1, int(round(count * test_fraction)))
    return np.sort(order[n_test:]), np.sort(order[:n_test])


# --- classification -----------------------------------------------------------------------------------------


def load_digits(tier_hw: Tuple[int, int], spec: PreprocessSpec, test_fraction: float, seed: int) -> SplitData:
    """scikit-learn's 1797 handwritten digits (8x8, 17 grey levels), scaled to 0..255, letterboxed."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    grey = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype(np.uint8)  # (N, 8, 8)
    originals = [cv2.cvtColor(small, cv2.COLOR_GRAY2BGR) for small in grey]
    images = np.empty((len(grey),) + tuple(tier_hw) + (3,), np.uint8)
    for i, original in enumerate(originals):
        images[i] = _letterbox_into(original, tier_hw, spec)[0]
    everything = ImageSet(
        images=images,
        sources=["digits[%d]" % i for i in range(len(grey))],
        labels=digits.target.astype(np.int64),
    )
    train_idx, test_idx = split_indices(len(everything), test_fraction, seed)
    return SplitData(
        everything.subset(train_idx),
        everything.subset(test_idx),
        [str(d) for d in range(10)],
        [originals[i] for i in test_idx[:GOLDEN_ORIGINALS]],
    )


def _image_files(directory: str) -> List[str]:
    return sorted(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.lower().endswith(IMAGE_SUFFIXES) and os.path.isfile(os.path.join(directory, name))
    )


def load_image_folder(
    root: str, tier_hw: Tuple[int, int], spec: PreprocessSpec, test_fraction: float, seed: int
) -> SplitData:
    """``root/<class name>/<image>``: class names are the sorted sub-directory names.

    A ``root/train`` + ``root/test`` pair (each an ImageFolder with the same classes) is used as given;
    otherwise one tree is split with ``test_fraction`` and ``seed``.
    """
    if not os.path.isdir(root):
        raise DatasetError("data.root %s: no such directory" % root)
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test")):
        train, labels = _read_image_folder(os.path.join(root, "train"), tier_hw, spec, None)
        test, _ = _read_image_folder(os.path.join(root, "test"), tier_hw, spec, labels)
        return SplitData(train, test, labels, _originals(test.sources))
    everything, labels = _read_image_folder(root, tier_hw, spec, None)
    train_idx, test_idx = split_indices(len(everything), test_fraction, seed)
    test = everything.subset(test_idx)
    return SplitData(everything.subset(train_idx), test, labels, _originals(test.sources))


def _originals(paths: Sequence[str]) -> List[np.ndarray]:
    return [read_image(path) for path in paths[:GOLDEN_ORIGINALS]]


def image_folder_labels(root: str) -> List[str]:
    """Class names of an ImageFolder tree (sorted sub-directories, of ``root/train`` when split)."""
    if not os.path.isdir(root):
        raise DatasetError("data.root %s: no such directory" % root)
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test")):
        root = os.path.join(root, "train")
    labels = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if len(labels) < 2:
        raise DatasetError(
            "%s: an ImageFolder needs at least two class sub-directories, found %d" % (root, len(labels))
        )
    return labels


def _read_image_folder(
    root: str, tier_hw: Tuple[int, int], spec: PreprocessSpec, expected_labels: Optional[List[str]]
) -> Tuple[ImageSet, List[str]]:
    labels = image_folder_labels(root)
    if expected_labels is not None and labels != expected_labels:
        raise DatasetError(
            "%s: classes %s differ from the training classes %s" % (root, labels, expected_labels)
        )
    files = [
        (path, index)
        for index, label in enumerate(labels)
        for path in _image_files(os.path.join(root, label))
    ]
    if not files:
        raise DatasetError("%s: no images (looked for %s)" % (root, ", ".join(IMAGE_SUFFIXES)))
    # Decode everything first: a broken file fails the run here, before any training.
    images = np.empty((len(files),) + tuple(tier_hw) + (3,), np.uint8)
    for i, (path, _) in enumerate(files):
        images[i] = _letterbox_into(read_image(path), tier_hw, spec)[0]
    targets = np.array([index for _, index in files], np.int64)
    return ImageSet(images=images, sources=[path for path, _ in files], labels=targets), labels


# --- detection ----------------------------------------------------------------------------------------------


def parse_yolo_labels(
    path: str, num_classes: int, image_hw: Tuple[int, int]
) -> Tuple[np.ndarray, np.ndarray]:
    """One YOLO label file (``class cx cy w h`` per line, normalised to 0..1) -> pixel xyxy boxes and classes.

    Errors name the file and line: a wrong field count, a non-number, a class outside ``0..num_classes-1`` or
    a coordinate outside 0..1.
    """
    boxes, classes = [], []
    height, width = image_hw
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            where = "%s:%d" % (path, number)
            if len(fields) != 5:
                raise DatasetError("%s: expected 5 fields (class cx cy w h), got %d" % (where, len(fields)))
            try:
                class_id = int(fields[0])
                cx, cy, bw, bh = (float(v) for v in fields[1:])
            except ValueError:
                raise DatasetError("%s: not numbers: %r" % (where, line.strip())) from None
            if not 0 <= class_id < num_classes:
                raise DatasetError("%s: class %d out of range 0..%d" % (where, class_id, num_classes - 1))
            if not all(0.0 <= v <= 1.0 for v in (cx, cy, bw, bh)):
                raise DatasetError("%s: coordinates must be normalised to 0..1, got %s" % (where, fields[1:]))
            boxes.append(
                [(cx - bw / 2) * width, (cy - bh / 2) * height, (cx + bw / 2) * width, (cy + bh / 2) * height]
            )
            classes.append(class_id)
    return np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int64)


def load_yolo(
    root: str,
    labels: Sequence[str],
    tier_hw: Tuple[int, int],
    spec: PreprocessSpec,
    test_fraction: float,
    seed: int,
) -> SplitData:
    """``root/images/*`` with ``root/labels/<stem>.txt`` (missing label file = no objects).

    ``root/images/train`` + ``root/images/val`` (and the same under labels/) are used as given when present.
    """
    images_dir = os.path.join(root, "images")
    if not os.path.isdir(images_dir):
        raise DatasetError("data.root %s: no images/ directory (YOLO layout: images/ and labels/)" % root)
    if not labels:
        raise DatasetError("data.labels: a YOLO data set needs its class names")
    if os.path.isdir(os.path.join(images_dir, "train")) and os.path.isdir(os.path.join(images_dir, "val")):
        train = _read_yolo_split(root, "train", len(labels), tier_hw, spec)
        test = _read_yolo_split(root, "val", len(labels), tier_hw, spec)
        return SplitData(train, test, list(labels), _originals([os.path.join(root, s) for s in test.sources]))
    everything = _read_yolo_split(root, "", len(labels), tier_hw, spec)
    train_idx, test_idx = split_indices(len(everything), test_fraction, seed)
    test = everything.subset(test_idx)
    return SplitData(
        everything.subset(train_idx),
        test,
        list(labels),
        _originals([os.path.join(root, s) for s in test.sources]),
    )


def _read_yolo_split(
    root: str, split: str, num_classes: int, tier_hw: Tuple[int, int], spec: PreprocessSpec
) -> ImageSet:
    images_dir = os.path.join(root, "images", split)
    labels_dir = os.path.join(root, "labels", split)
    files = _image_files(images_dir)
    if not files:
        raise DatasetError("%s: no images (looked for %s)" % (images_dir, ", ".join(IMAGE_SUFFIXES)))
    parsed = []
    for path in files:  # parse every label file and decode every image before any training
        image = read_image(path)
        label_path = os.path.join(labels_dir, os.path.splitext(os.path.basename(path))[0] + ".txt")
        if os.path.isfile(label_path):
            boxes, classes = parse_yolo_labels(label_path, num_classes, image.shape[:2])
        else:
            boxes, classes = np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
        parsed.append((image, boxes, classes))
    return _letterbox_detection(parsed, [os.path.relpath(p, root) for p in files], tier_hw, spec)


def _letterbox_detection(
    scenes: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]],
    sources: List[str],
    tier_hw: Tuple[int, int],
    spec: PreprocessSpec,
) -> ImageSet:
    images = np.empty((len(scenes),) + tuple(tier_hw) + (3,), np.uint8)
    all_boxes, all_classes = [], []
    for i, (image, boxes, classes) in enumerate(scenes):
        images[i], gain, left, top = _letterbox_into(image, tier_hw, spec)
        all_boxes.append(_map_boxes(boxes, gain, left, top))
        all_classes.append(classes.astype(np.int64))
    return ImageSet(images=images, sources=sources, boxes=all_boxes, classes=all_classes)


def shapes_scene_hw(rng: np.random.Generator) -> Tuple[int, int]:
    """A random scene size from :data:`SHAPES_ASPECTS`, so letterboxing pads different sides."""
    aspect_h, aspect_w = SHAPES_ASPECTS[int(rng.integers(0, len(SHAPES_ASPECTS)))]
    long_side = int(rng.integers(SHAPES_LONG_SIDE[0], SHAPES_LONG_SIDE[1] + 1))
    scale = long_side / max(aspect_h, aspect_w)
    return max(32, int(round(aspect_h * scale))), max(32, int(round(aspect_w * scale)))


def generate_shapes(
    count: int, seed: int, tier_hw: Tuple[int, int], spec: PreprocessSpec
) -> Tuple[ImageSet, List[np.ndarray]]:
    """``count`` generated scenes of mixed aspect ratios letterboxed to the tier (deterministic per seed), and
    the first scenes at their original size."""
    rng = np.random.default_rng(seed)
    scenes = [generate_scene(rng, shapes_scene_hw(rng)) for _ in range(count)]
    images = _letterbox_detection(scenes, ["shapes[%d:%d]" % (seed, i) for i in range(count)], tier_hw, spec)
    return images, [scene[0] for scene in scenes[:GOLDEN_ORIGINALS]]


# The held-out scenes come from this offset of the training seed, so they never repeat a training scene.
SHAPES_TEST_SEED_OFFSET = 7919


def load_shapes(
    tier_hw: Tuple[int, int], spec: PreprocessSpec, train_count: int, test_count: int, seed: int
) -> SplitData:
    """Generated scenes; the test set comes from a different seed, so it is held out by construction."""
    train, _ = generate_shapes(train_count, seed, tier_hw, spec)
    test, originals = generate_shapes(test_count, seed + SHAPES_TEST_SEED_OFFSET, tier_hw, spec)
    return SplitData(train, test, list(SHAPE_LABELS), originals)


def describe(data: SplitData) -> Dict[str, int]:
    return {"train": len(data.train), "test": len(data.test), "classes": len(data.labels)}
