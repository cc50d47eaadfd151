"""Rebuild a bundle's ``float.ckpt`` and ``qat.ckpt`` from its own MindIRs, so ``qat --resume`` can regenerate it
without training (how the demo bundle gained its int8 ONNX; docs/quant.md, "What was measured").

The main tier's float MindIR holds every float parameter; its int8-sim MindIR, exported from the trained QAT
network, holds every QAT parameter, quantizer ranges included. Each checkpoint is stamped with the config's
fingerprint and the bundle report's metrics, as a run that trained it would have::

    python -m quant.checkpoints_from_bundle --config quant/examples/shapes.yaml --bundle examples/demo-bundle \
        --work-dir /tmp/work
    atlas-edge qat --config quant/examples/shapes.yaml --out examples/demo-bundle --resume --work-dir /tmp/work
"""

import argparse
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

MINDIR_FLOAT32 = 1  # mind_ir.proto TensorProto.DataType FLOAT


def mindir_parameters(path: str) -> Dict[str, Any]:
    """Name (without the graph prefix before ':') -> mindspore Parameter of every float32 MindIR parameter."""
    import mindspore as ms
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as handle:
        model.ParseFromString(handle.read())
    found = {}
    for tensor in model.graph.parameter:
        name = tensor.name.split(":", 1)[-1]
        if tensor.data_type != MINDIR_FLOAT32 or len(tensor.raw_data) != 4 * int(np.prod(tensor.dims)):
            raise ValueError("%s: parameter %s is not raw float32" % (path, name))
        value = np.frombuffer(tensor.raw_data, np.float32).reshape(tuple(tensor.dims)).copy()
        found[name] = ms.Parameter(ms.Tensor(value), name=name)
    return found


def _load(network: Any, params: Dict[str, Any], source: str) -> None:
    """Every parameter but the quantizers' step counters (not exported) must come from ``source``."""
    import mindspore as ms

    wanted = {p.name.split("network.", 1)[-1] for p in network.get_parameters()}
    missing = sorted(n for n in wanted - set(params) if not n.endswith("._steps"))
    if missing:
        raise ValueError("%s lacks %s" % (source, ", ".join(missing[:8])))
    ms.load_param_into_net(network, params)


def rebuild(config_path: str, bundle: str, work_dir: str) -> List[str]:
    """Write float.ckpt and qat.ckpt (with their stamps) into ``work_dir``; returns their paths."""
    from converters.bundle_writer import tier_name
    from quant.config import load_config
    from quant.fake_quant import apply_quantization, build_algorithm
    from quant.pipeline import QatRun, RunOptions, dataset_labels
    from quant.training import use_graph_mode_on

    use_graph_mode_on("CPU")
    config = load_config(config_path)
    with open(os.path.join(bundle, "report.json"), encoding="utf-8") as handle:
        report = json.load(handle)
    run = QatRun(config, RunOptions(out_dir=bundle, resume=True, work_dir=work_dir))
    run.labels = list(config.labels) or dataset_labels(config)
    main = tier_name(tuple(config.export.tiers[0]))
    float_net = run.build_network()
    _load(float_net, mindir_parameters(os.path.join(bundle, "model_%s.mindir" % main)), "the float MindIR")
    run._save_checkpoint(float_net, "float", report["float"])
    q = config.qat
    algorithm = build_algorithm("cpu", q.per_channel, q.symmetric_weights, q.quant_delay)
    qat_net = apply_quantization(algorithm, run.build_network(), work_dir)
    _load(qat_net, mindir_parameters(os.path.join(bundle, "model_%s.int8sim.mindir" % main)), "the int8-sim MindIR")
    run._save_checkpoint(qat_net, "qat", report["qat"])
    return [run._checkpoint("float"), run._checkpoint("qat")]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the QAT config the bundle was made with")
    parser.add_argument("--bundle", required=True, help="the bundle (its main tier's float and int8-sim MindIR)")
    parser.add_argument("--work-dir", required=True, help="where the checkpoints go (qat --work-dir)")
    args = parser.parse_args(argv)
    for path in rebuild(args.config, args.bundle, args.work_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
