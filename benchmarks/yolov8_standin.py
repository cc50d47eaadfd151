"""A YOLOv8n-shaped ONNX built here with the ``onnx`` package, for when no Ultralytics export is at hand.

Same graph as Ultralytics' ``yolov8n.pt`` exported with ``export(format="onnx", opset=12)``: the yolov8.yaml
backbone and PAN neck at scale n (width 0.25, depth 0.33: Conv+SiLU with BatchNorm folded, C2f, SPPF, nearest
Upsample, Concat), the Detect head (two 3x3 Convs and a 1x1 per branch, per level) and its export-time decode
(DFL softmax and 1x1 Conv of arange(16), anchors, strides, class sigmoid), output ``(1, 4 + 80, 8400)`` at 640x640.
The weights are random (He-scaled, so activations keep their spread through the depth): the figures measured on
it are speed and the *agreement* between runtimes and precisions, never accuracy, and the JSON says so.
"""

from typing import Any, List, Tuple

import numpy as np

STANDIN_NAME = "yolov8n-shaped stand-in (random weights)"
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


def build_yolov8n(path: str, imgsz: int = IMGSZ, seed: int = SEED) -> str:
    """Write the stand-in to ``path`` (input ``images`` (1, 3, imgsz, imgsz), output ``output0``); returns path."""
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
