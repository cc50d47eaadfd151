"""The models the ``quant`` section compares, each as a set of *lanes*: one artifact on one runtime.

* ``demo``: the committed demo detector (examples/demo-bundle, 256x256). Its float ONNX on onnxruntime with the
  input folded in (uint8 BGR NHWC, as the box feeds ONNX now), its int8 ONNX with the QAT scales
  (``model_256x256.int8.onnx``, when the bundle has one), onnxruntime's own static PTQ of the float ONNX
  (converters/byom/int8.py, calibrated on generated scenes), the float ONNX on cv2.dnn fed the host-normalised
  float tensor (the CPU path before onnxruntime), and the float ``.ms`` on MindSpore Lite (the Lite lane).
* ``yolov8n``: a YOLOv8n-shaped stand-in (benchmarks/yolov8_standin.py, trained weights widened, 640x640) made into a
  bundle by ``bundle create --int8`` itself, so its lanes are exactly what a user's Ultralytics export gets.
"""

import dataclasses
import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

CALIBRATION_SEED = 5  # generated calibration scenes for the demo's PTQ lane (never the held-out split)
# 16:9 frames (a 1080p camera's shape, scaled down) letterboxed to 640x640 at gain 1: the scenes' objects (9-28 %
# of the shorter side) come out at 32-100 px, near the 23-72 px the stand-in's trained weights learnt on 256x256
# scenes (4:3 frames give 43-134 px, where the narrow detector is less sure and its scores crowd conf)
STANDIN_SCENE_HW = (360, 640)


@dataclasses.dataclass
class Lane:
    """One artifact on one runtime, fed the way the box feeds it."""

    name: str  # ort_float | ort_int8_qat | ort_int8_ptq | opencv_float | lite_float
    backend: str  # the agent's backend name: onnxruntime | opencv | mslite
    path: str
    precision: str  # float32 | int8
    model_input: bool  # uint8 BGR NHWC in (normalisation folded into the model), else float NCHW from the host


@dataclasses.dataclass
class ModelUnderTest:
    key: str
    label: str
    bundle_dir: str  # for the Lite lane (converted to .ms there)
    tier: Tuple[int, int]
    task: str
    spec: Any  # the manifest's preprocessing
    post: Any  # the manifest's postprocessing
    input_name: str
    lanes: List[Lane]
    skipped: Dict[str, str]
    notes: List[str]


def _artifact(manifest: Any, tier: Tuple[int, int], precision: str, normalize_on: Optional[str] = None) -> Any:
    for art in manifest.artifacts:
        if art.format == "onnx" and tuple(art.tier) == tier and art.batch == 1 and art.precision == precision \
                and (normalize_on is None or art.normalize_on == normalize_on):
            return art
    return None


def demo_model(bundle_dir: str, work_dir: str, calibration_count: int) -> ModelUnderTest:
    """The demo bundle's lanes; the folded float ONNX and the PTQ int8 ONNX are made in ``work_dir``."""
    from agent.bundle.verify import verify_bundle
    from converters.byom.int8 import quantize_int8
    from converters.onnx_input import fold_input_file

    bundle = verify_bundle(bundle_dir)
    manifest = bundle.manifest
    tier = tuple(manifest.input.tiers[0])
    spec = manifest.preprocessing
    host = _artifact(manifest, tier, "float32", "host")
    folded = _artifact(manifest, tier, "float32", "model")
    if host is None and folded is None:
        raise RuntimeError("bundle %s has no float ONNX of tier %dx%d" % (bundle_dir, tier[0], tier[1]))
    notes: List[str] = []
    lanes: List[Lane] = []
    skipped: Dict[str, str] = {}
    if folded is not None:
        folded_path = bundle.path(folded.file)
    else:
        folded_path = os.path.join(work_dir, "demo_float_folded.onnx")
        fold_input_file(bundle.path(host.file), folded_path, spec)
        notes.append("ort_float: %s with the input folded in here (converters/onnx_input.py)" % host.file)
    lanes.append(Lane("ort_float", "onnxruntime", folded_path, "float32", True))
    qat = _artifact(manifest, tier, "int8")
    if qat is not None:
        lanes.append(Lane("ort_int8_qat", "onnxruntime", bundle.path(qat.file), "int8", qat.normalize_on == "model"))
    else:
        skipped["ort_int8_qat"] = "the bundle has no int8 ONNX (atlas-edge qat writes model_<tier>.int8.onnx)"
    if host is not None:
        ptq = os.path.join(work_dir, "demo_ptq.int8.onnx")
        quantize_int8(bundle.path(host.file), ptq, spec, tier, calibration_scenes(calibration_count))
        lanes.append(Lane("ort_int8_ptq", "onnxruntime", ptq, "int8", True))
        lanes.append(Lane("opencv_float", "opencv", bundle.path(host.file), "float32", False))
    else:
        skipped["ort_int8_ptq"] = skipped["opencv_float"] = "no host-normalised float ONNX to start from"
    return ModelUnderTest("demo", "%s %s (examples/demo-bundle)" % (manifest.name, manifest.version), bundle_dir,
                          tier, manifest.task, spec, manifest.postprocessing, manifest.input.name, lanes, skipped,
                          notes)


def calibration_scenes(count: int) -> List[Any]:
    from agent.devtools.scenes import generate_scenes

    return [image for image, _boxes, _classes in generate_scenes(CALIBRATION_SEED, count, STANDIN_SCENE_HW)]


def standin_model(work_dir: str, calibration_count: int) -> ModelUnderTest:
    """The YOLOv8n-shaped stand-in through ``bundle create --int8``, its check enforced as for a user's model (no
    ``--force``): the stand-in carries trained weights (benchmarks/yolov8_standin.py), so the float model finds
    the scenes' objects and the int8 one must keep them."""
    import cv2

    from agent.bundle.verify import verify_bundle
    from benchmarks.yolov8_standin import IMGSZ, STANDIN_NAME, build_yolov8n
    from converters.byom.create import INT8_CHECK_FILE, create_bundle
    from converters.byom.decide import CreateOptions

    model_path = build_yolov8n(os.path.join(work_dir, "yolov8n_standin.onnx"))
    images = os.path.join(work_dir, "standin-images")
    os.makedirs(images, exist_ok=True)
    for i, image in enumerate(calibration_scenes(calibration_count)):
        cv2.imwrite(os.path.join(images, "scene%03d.png" % i), image)
    out = os.path.join(work_dir, "standin-bundle")
    create_bundle(CreateOptions(model=model_path, out=out, images=images, int8=True, golden=1,
                                calibration=1))
    bundle = verify_bundle(out)
    manifest = bundle.manifest
    tier = (IMGSZ, IMGSZ)
    lanes = [Lane("ort_float", "onnxruntime", bundle.path(_artifact(manifest, tier, "float32", "model").file),
                  "float32", True),
             Lane("ort_int8_ptq", "onnxruntime", bundle.path(_artifact(manifest, tier, "int8").file), "int8", True),
             Lane("opencv_float", "opencv", bundle.path(_artifact(manifest, tier, "float32", "host").file),
                  "float32", False)]
    with open(bundle.path(INT8_CHECK_FILE)) as handle:
        check = json.load(handle)
    return ModelUnderTest("yolov8n", STANDIN_NAME, out, tier, manifest.task, manifest.preprocessing,
                          manifest.postprocessing, manifest.input.name, lanes, {"ort_int8_qat": "no QAT for it"},
                          ["made by bundle create --int8; its int8 check: %s" % json.dumps(
                              check["checks"], sort_keys=True)])
