"""A YOLOv8n-shaped ONNX built here with the ``onnx`` package, for when no Ultralytics export is at hand.

Same graph as Ultralytics' ``yolov8n.pt`` exported with ``export(format="onnx", opset=12)``: the yolov8.yaml
backbone and PAN neck at scale n (width 0.25, depth 0.33: Conv+SiLU with BatchNorm folded, C2f, SPPF, nearest
Upsample, Concat), the Detect head (two 3x3 Convs and a 1x1 per branch, per level) and its export-time decode
(DFL softmax and 1x1 Conv of arange(16), anchors, strides, class sigmoid), output ``(1, 4 + 80, 8400)`` at 640x640.
The weights are those of the tests' trained YOLOv8 (tests/fixtures/byom/yolov8t.onnx: Ultralytics' own export of
yolov8.yaml at 1/16 width, trained on the generated scenes) *widened* to n width by channel replication
(Net2Net's function-preserving widening, Chen et al. 2016): every new channel copies an old one, and a
convolution reading k copies of an old channel divides those weights by k. The stand-in therefore computes
exactly what the trained network computes (its 3 shape classes first; the other 77 never fire), at YOLOv8n's
cost: its timings are a YOLOv8n's, and its detections on scenes are real ones, confident like a trained model's,
so ``bundle create --int8``'s check has objects to keep. Its int8 behaviour is the narrow network's (copies share
their ranges), not a real YOLOv8n's. ``trained=None`` gives the random (He-scaled) weights instead.
"""

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

STANDIN_NAME = "yolov8n-shaped stand-in (the tests' trained 1/16-width YOLOv8, widened)"
TRAINED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "byom",
                       "yolov8t.onnx")
DEAD_CLASS_BIAS = -20.0  # the classes the trained network lacks: sigmoid(-20) = 2e-9, never above any conf
DEAD_CLASS_STD = 1e-3  # small, not zero: a per-channel int8 weight scale of 0 is degenerate
IMGSZ = 640
NUM_CLASSES = 80
REG_MAX = 16
STRIDES = (8, 16, 32)
OPSET = 12  # Ultralytics' export default for OpenCV-friendly graphs (tests/fixtures/byom uses the same)
SEED = 8
# Class logits with a spread of about 1.5 around -5.6 (the last conv's weights x CLASS_GAIN): some tens of the
# 8400 x 80 scores pass conf 0.25, as on a scene with a few objects, so decoding and agreement have work to do
CLASS_GAIN, CLASS_BIAS = 10.0, -5.6


class _Graph:
    """Nodes and initializers of the stand-in, named like Ultralytics' export (``/model.N/...``)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: List[Any] = []
        self.inits: List[Any] = []

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: List[str], name: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, [name + "_output_0"], name=name, **attrs))
        return name + "_output_0"

    def conv(self, x: str, c1: int, c2: int, k: int, s: int, name: str, act: bool = True,
             bias: float = 0.0, gain: float = 1.0) -> str:
        """Conv (BatchNorm folded: a bias) and SiLU as Sigmoid * x, as the export writes it."""
        scale = gain * np.sqrt(2.0 / (c1 * k * k))
        w = self.const(name + ".weight", (self.rng.normal(0, scale, (c2, c1, k, k))).astype(np.float32))
        b = self.const(name + ".bias", np.full(c2, bias, np.float32) + self.rng.normal(0, 0.1, c2).astype(
            np.float32))
        y = self.node("Conv", [x, w, b], name + "/Conv", kernel_shape=[k, k], strides=[s, s],
                      pads=[k // 2] * 4, dilations=[1, 1], group=1)
        if not act:
            return y
        return self.node("Mul", [y, self.node("Sigmoid", [y], name + "/act/Sigmoid")], name + "/act/Mul")

    def c2f(self, x: str, c1: int, c2: int, n: int, shortcut: bool, name: str) -> str:
        c = c2 // 2
        y = self.conv(x, c1, 2 * c, 1, 1, name + "/cv1")
        split = [name + "/Split_output_0", name + "/Split_output_1"]
        from onnx import helper

        self.nodes.append(helper.make_node("Split", [y], split, name=name + "/Split", axis=1, split=[c, c]))
        parts = list(split)
        for i in range(n):
            h = self.conv(parts[-1], c, c, 3, 1, "%s/m.%d/cv1" % (name, i))
            h = self.conv(h, c, c, 3, 1, "%s/m.%d/cv2" % (name, i))
            if shortcut:
                h = self.node("Add", [parts[-1], h], "%s/m.%d/Add" % (name, i))
            parts.append(h)
        return self.conv(self.node("Concat", parts, name + "/Concat", axis=1), (2 + n) * c, c2, 1, 1, name + "/cv2")

    def sppf(self, x: str, c1: int, c2: int, name: str) -> str:
        c = c1 // 2
        y = [self.conv(x, c1, c, 1, 1, name + "/cv1")]
        for i in range(3):
            y.append(self.node("MaxPool", [y[-1]], "%s/m/MaxPool_%d" % (name, i), kernel_shape=[5, 5],
                               strides=[1, 1], pads=[2, 2, 2, 2]))
        return self.conv(self.node("Concat", y, name + "/Concat", axis=1), 4 * c, c2, 1, 1, name + "/cv2")

    def upsample(self, x: str, name: str) -> str:
        scales = self.const(name + "/scales", np.array([1, 1, 2, 2], np.float32))
        roi = self.const(name + "/roi", np.zeros(0, np.float32))
        return self.node("Resize", [x, roi, scales], name + "/Resize", mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _anchors(imgsz: int) -> Tuple[np.ndarray, np.ndarray]:
    """Anchor centres (2, N) in grid units and strides (1, N), the shapes Ultralytics' export gives them."""
    points, strides = [], []
    for s in STRIDES:
        g = imgsz // s
        ys, xs = np.meshgrid(np.arange(g) + 0.5, np.arange(g) + 0.5, indexing="ij")
        points.append(np.stack([xs.ravel(), ys.ravel()]))
        strides.append(np.full(g * g, s))
    return np.concatenate(points, 1).astype(np.float32), np.concatenate(strides)[None].astype(np.float32)


def _detect(g: _Graph, features: List[Tuple[str, int]], imgsz: int) -> str:
    c2, c3 = max(16, features[0][1] // 4, 4 * REG_MAX), max(features[0][1], min(NUM_CLASSES, 100))
    boxes, classes = [], []
    for i, (x, ch) in enumerate(features):
        b = g.conv(g.conv(x, ch, c2, 3, 1, "/model.22/cv2.%d/cv2.%d.0" % (i, i)), c2, c2, 3, 1,
                   "/model.22/cv2.%d/cv2.%d.1" % (i, i))
        b = g.conv(b, c2, 4 * REG_MAX, 1, 1, "/model.22/cv2.%d/cv2.%d.2" % (i, i), act=False, bias=1.0)
        c = g.conv(g.conv(x, ch, c3, 3, 1, "/model.22/cv3.%d/cv3.%d.0" % (i, i)), c3, c3, 3, 1,
                   "/model.22/cv3.%d/cv3.%d.1" % (i, i))
        c = g.conv(c, c3, NUM_CLASSES, 1, 1, "/model.22/cv3.%d/cv3.%d.2" % (i, i), act=False, bias=CLASS_BIAS,
                   gain=CLASS_GAIN)
        boxes.append(g.node("Reshape", [b, g.const("/model.22/box_shape_%d" % i, np.array([1, 4 * REG_MAX, -1]))],
                            "/model.22/Reshape_box_%d" % i))
        classes.append(g.node("Reshape", [c, g.const("/model.22/cls_shape_%d" % i, np.array([1, NUM_CLASSES, -1]))],
                              "/model.22/Reshape_cls_%d" % i))
    box = g.node("Concat", boxes, "/model.22/Concat", axis=2)  # (1, 64, N)
    cls = g.node("Concat", classes, "/model.22/Concat_1", axis=2)  # (1, 80, N)
    # DFL: (1, 64, N) -> (1, 4, 16, N) -> (1, 4, N, 16) softmax over the bins (the last axis: opset 12's Softmax
    # flattens from its axis on) -> (1, 16, 4, N) -> 1x1 Conv of arange(16) -> (1, 1, 4, N) -> (1, 4, N)
    d = g.node("Reshape", [box, g.const("/model.22/dfl/shape", np.array([1, 4, REG_MAX, -1]))], "/model.22/dfl/Reshape")
    d = g.node("Transpose", [d], "/model.22/dfl/Transpose", perm=[0, 1, 3, 2])
    d = g.node("Softmax", [d], "/model.22/dfl/Softmax", axis=3)
    d = g.node("Transpose", [d], "/model.22/dfl/Transpose_1", perm=[0, 3, 1, 2])
    w = g.const("model.22.dfl.conv.weight", np.arange(REG_MAX, dtype=np.float32).reshape(1, REG_MAX, 1, 1))
    d = g.node("Conv", [d, w], "/model.22/dfl/conv/Conv", kernel_shape=[1, 1])
    d = g.node("Reshape", [d, g.const("/model.22/dfl/shape_1", np.array([1, 4, -1]))], "/model.22/dfl/Reshape_1")
    axis = g.const("/model.22/axis", np.array([1]))  # two Slices, as the export writes the chunk(2, 1)
    lt = g.node("Slice", [d, g.const("/model.22/lt_start", np.array([0])), g.const("/model.22/lt_end", np.array([2])),
                          axis], "/model.22/Slice")
    rb = g.node("Slice", [d, g.const("/model.22/rb_start", np.array([2])), g.const("/model.22/rb_end", np.array([4])),
                          axis], "/model.22/Slice_1")
    anchors, strides = _anchors(imgsz)
    a = g.const("/model.22/anchors", anchors)
    x1y1 = g.node("Sub", [a, lt], "/model.22/Sub")
    x2y2 = g.node("Add", [a, rb], "/model.22/Add_1")
    centre = g.node("Div", [g.node("Add", [x1y1, x2y2], "/model.22/Add_2"), g.const("/model.22/two",
                                                                                   np.array(2, np.float32))],
                    "/model.22/Div_1")
    wh = g.node("Sub", [x2y2, x1y1], "/model.22/Sub_1")
    xywh = g.node("Mul", [g.node("Concat", [centre, wh], "/model.22/Concat_2", axis=1),
                          g.const("/model.22/strides", strides)], "/model.22/Mul_2")
    scores = g.node("Sigmoid", [cls], "/model.22/Sigmoid")
    return g.node("Concat", [xywh, scores], "/model.22/Concat_3", axis=1)


def _trained_convs(onnx: Any, path: str) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """(weight, bias) of each Conv of an Ultralytics export, by the stand-in's node name (``/conv/Conv`` ->
    ``/Conv``: the export names the Conv inside each Conv+BN+SiLU module ``conv``)."""
    from onnx import numpy_helper

    model = onnx.load(path)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.name.replace("/conv/Conv", "/Conv"): (inits[n.input[1]], inits[n.input[2]])
            for n in model.graph.node if n.op_type == "Conv" and len(n.input) == 3 and n.input[1] in inits}


def _widen(g: _Graph, trained: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
    """Replace ``g``'s random weights by ``trained``'s, widened (module docstring). ``maps`` gives each tensor's
    channel map: new channel -> the old channel it copies; new channels copy old ones in blocks, so that the
    halves a C2f Split takes stay halves and a Concat's parts stay in order."""
    from onnx import numpy_helper

    inits = {t.name: i for i, t in enumerate(g.inits)}
    maps: Dict[str, np.ndarray] = {"images": np.arange(3)}
    for node in g.nodes:
        ins = [maps.get(x) for x in node.input]
        if node.op_type == "Conv" and ins[0] is not None and node.name in trained:
            w_old, b_old = trained[node.name]
            w_name, b_name = node.input[1], node.input[2]
            c_new, c_old = g.inits[inits[w_name]].dims[0], w_old.shape[0]
            out = _block_map(c_new, c_old) if c_new % c_old == 0 else np.arange(c_new)
            copies = np.bincount(ins[0], minlength=w_old.shape[1])
            w = w_old[np.minimum(out, c_old - 1)][:, ins[0]] / copies[ins[0]][None, :, None, None]
            b = b_old[np.minimum(out, c_old - 1)].copy()
            if c_new % c_old:  # the class conv: the trained classes first, the rest dead
                w[c_old:] = g.rng.normal(0, DEAD_CLASS_STD, w[c_old:].shape)
                b[c_old:] = DEAD_CLASS_BIAS
            g.inits[inits[w_name]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), w_name))
            g.inits[inits[b_name]].CopyFrom(numpy_helper.from_array(b.astype(np.float32), b_name))
            maps[node.output[0]] = out
        elif node.op_type == "Split" and ins[0] is not None:
            half_new, half_old = len(ins[0]) // 2, (int(ins[0].max()) + 1) // 2
            maps[node.output[0]], maps[node.output[1]] = ins[0][:half_new], ins[0][half_new:] - half_old
        elif node.op_type == "Concat" and all(m is not None for m in ins):
            offsets = np.cumsum([0] + [int(m.max()) + 1 for m in ins[:-1]])
            maps[node.output[0]] = np.concatenate([m + o for m, o in zip(ins, offsets)])
        elif node.op_type in ("Sigmoid", "Mul", "Add", "MaxPool", "Resize") and ins[0] is not None:
            if not all(m is None or np.array_equal(m, ins[0]) for m in ins):
                raise ValueError("%s: inputs widened differently" % node.name)
            maps[node.output[0]] = ins[0]
    missing = set(trained) - {n.name for n in g.nodes if n.output[0] in maps}
    if missing:
        raise ValueError("trained convolutions the stand-in has no place for: %s" % sorted(missing))


def _block_map(c_new: int, c_old: int) -> np.ndarray:
    """New channel -> old channel, each old channel copied c_new / c_old times in a block."""
    return np.arange(c_new) // (c_new // c_old)


def build_yolov8n(path: str, imgsz: int = IMGSZ, seed: int = SEED, trained: Optional[str] = TRAINED) -> str:
    """Write the stand-in to ``path`` (input ``images`` (1, 3, imgsz, imgsz), output ``output0``); returns path.
    ``trained``: the Ultralytics export whose weights it carries, widened (None: random weights)."""
    from converters.byom.model_file import import_onnx

    onnx = import_onnx()  # MindSpore before onnx in a host process (protobuf's implementation)
    from onnx import helper

    g = _Graph(seed)
    x = g.conv("images", 3, 16, 3, 2, "/model.0")
    x = g.conv(x, 16, 32, 3, 2, "/model.1")
    x = g.c2f(x, 32, 32, 1, True, "/model.2")
    x = g.conv(x, 32, 64, 3, 2, "/model.3")
    p3 = g.c2f(x, 64, 64, 2, True, "/model.4")
    x = g.conv(p3, 64, 128, 3, 2, "/model.5")
    p4 = g.c2f(x, 128, 128, 2, True, "/model.6")
    x = g.conv(p4, 128, 256, 3, 2, "/model.7")
    x = g.c2f(x, 256, 256, 1, True, "/model.8")
    p5 = g.sppf(x, 256, 256, "/model.9")
    x = g.node("Concat", [g.upsample(p5, "/model.10"), p4], "/model.11/Concat", axis=1)
    n4 = g.c2f(x, 384, 128, 1, False, "/model.12")
    x = g.node("Concat", [g.upsample(n4, "/model.13"), p3], "/model.14/Concat", axis=1)
    out3 = g.c2f(x, 192, 64, 1, False, "/model.15")
    x = g.node("Concat", [g.conv(out3, 64, 64, 3, 2, "/model.16"), n4], "/model.17/Concat", axis=1)
    out4 = g.c2f(x, 192, 128, 1, False, "/model.18")
    x = g.node("Concat", [g.conv(out4, 128, 128, 3, 2, "/model.19"), p5], "/model.20/Concat", axis=1)
    out5 = g.c2f(x, 384, 256, 1, False, "/model.21")
    y = _detect(g, [(out3, 64), (out4, 128), (out5, 256)], imgsz)
    if trained:
        _widen(g, _trained_convs(onnx, trained))
    g.nodes[-1].output[0] = "output0"
    anchors = sum((imgsz // s) ** 2 for s in STRIDES)
    graph = helper.make_graph(
        g.nodes, "yolov8n-standin",
        [helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, [1, 3, imgsz, imgsz])],
        [helper.make_tensor_value_info("output0", onnx.TensorProto.FLOAT, [1, 4 + NUM_CLASSES, anchors])],
        g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="atlas-edge bench")
    model.ir_version = 7
    del y
    names = {i: "class%d" % i for i in range(NUM_CLASSES)}
    for key, value in (("stride", "32"), ("task", "detect"), ("imgsz", str([imgsz, imgsz])), ("names", str(names))):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path
