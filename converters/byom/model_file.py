"""What a model file says about itself, read without running it: its input, outputs and exporter metadata."""

import dataclasses
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

Tier = Tuple[int, int]
ONNX_FLOAT = 1  # onnx.TensorProto.FLOAT
MINDIR_FLOAT = 1  # mind_ir DataType FLOAT32


class CreateError(ValueError):
    """Input that cannot become a bundle; the message names the cause and, where one exists, the flag to fix it."""


@dataclasses.dataclass
class ModelInfo:
    """What the model file says about itself, read without running it."""

    path: str
    format: str  # onnx | mindir
    input_name: str
    input_shape: List[Optional[int]]  # None: a dynamic axis
    output_names: List[str]
    metadata: Dict[str, str]
    producer: str

    @property
    def dynamic(self) -> bool:
        return any(d is None for d in self.input_shape)

    @property
    def from_ultralytics(self) -> bool:
        return self.metadata.get("author", "").startswith("Ultralytics")


# --- reading the model -------------------------------------------------------------------------------------

def import_onnx() -> Any:
    # MindSpore selects the pure-Python protobuf when it is imported (its generated code needs it); importing onnx
    # first would fix the C implementation for the whole process and break MindSpore ("Descriptors cannot be
    # created directly"). So MindSpore goes first, whenever onnx is used in a host process that has it.
    try:
        import mindspore  # noqa: F401
    except ImportError:  # a lane without MindSpore (the box's Python 3.7 with onnx): no conflict to avoid
        pass

    try:
        import onnx
    except ImportError:
        raise CreateError("reading an ONNX model needs the onnx package: pip install 'atlas-edge[host]'") from None
    return onnx


def inspect_model(path: str) -> ModelInfo:
    """Read inputs, outputs and exporter metadata of an ONNX or MindIR file; CreateError if it is neither."""
    if not os.path.isfile(path):
        raise CreateError("--model %s: no such file" % path)
    if path.lower().endswith(".mindir"):
        return _inspect_mindir(path)
    try:
        return _inspect_onnx(path)
    except CreateError as onnx_error:
        if path.lower().endswith(".onnx"):
            raise
        try:
            return _inspect_mindir(path)
        except CreateError:
            raise CreateError("--model %s: not an ONNX or MindIR model (%s)" % (path, onnx_error)) from None


def dims(value_info: Any) -> List[Optional[int]]:
    shape = value_info.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in shape.dim]


def _inspect_onnx(path: str) -> ModelInfo:
    onnx = import_onnx()
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CreateError("--model %s: not an ONNX model (%s)" % (path, str(exc) or type(exc).__name__)) from None
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if not graph.node or not inputs or not graph.output:
        raise CreateError("--model %s: not an ONNX model (no graph: %d nodes, %d inputs, %d outputs)" % (
            path, len(graph.node), len(inputs), len(graph.output)))
    if len(inputs) != 1:
        raise CreateError("--model %s has %d inputs (%s); the agent feeds one image tensor" % (
            path, len(inputs), ", ".join(i.name for i in inputs)))
    elem_type = inputs[0].type.tensor_type.elem_type
    if elem_type != ONNX_FLOAT:
        raise CreateError("--model %s: input %s is %s, the agent feeds float32 (export without half/int8)" % (
            path, inputs[0].name, onnx.TensorProto.DataType.Name(elem_type)))
    info = ModelInfo(path=path, format="onnx", input_name=inputs[0].name, input_shape=dims(inputs[0]),
                     output_names=[o.name for o in graph.output],
                     metadata={p.key: p.value for p in model.metadata_props},
                     producer=" ".join(x for x in (model.producer_name, model.producer_version) if x) or "unknown")
    if info.from_ultralytics:  # the exporter, not the framework underneath it ("pytorch 2.x")
        info.producer = "Ultralytics %s" % info.metadata.get("version", "?")
    return info


def _inspect_mindir(path: str) -> ModelInfo:
    from google.protobuf.message import DecodeError
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    try:
        with open(path, "rb") as handle:
            model.ParseFromString(handle.read())
    except DecodeError as exc:
        raise CreateError("--model %s: not a MindIR model (%s)" % (path, exc)) from None
    graph = model.graph
    if not graph.node or not graph.input or not graph.output:
        raise CreateError("--model %s: not a MindIR model (no graph)" % path)
    if len(graph.input) != 1:
        raise CreateError("--model %s has %d inputs (%s); the agent feeds one image tensor" % (
            path, len(graph.input), ", ".join(i.name for i in graph.input)))
    tensor = graph.input[0].tensor[0]
    if tensor.data_type != MINDIR_FLOAT:
        raise CreateError("--model %s: input %s is not float32 (MindIR data type %d)" % (
            path, graph.input[0].name, tensor.data_type))
    producer = " ".join(x for x in (model.producer_name, model.producer_version) if x) or "unknown"
    return ModelInfo(path=path, format="mindir", input_name=graph.input[0].name,
                     input_shape=[d if d > 0 else None for d in tensor.dims],
                     output_names=[o.name for o in graph.output], metadata={}, producer=producer)


# --- deciding tiers, task and labels ------------------------------------------------------------------------
