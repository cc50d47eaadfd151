"""Stand-ins for runtimes that cannot run on the development machine (MindSpore Lite, pyACL).

They are fakes, not the real runtimes: each implements the slice of the documented API our backends call,
with the real API's argument conventions and checks, records every call, and runs a toy "model" described by
a small JSON file, so tests can check call order, buffer handling, shapes, dtypes and error paths. Passing
tests against them says the adapter follows the documented API; it does not say the adapter ran on an NPU.
"""

import json
from typing import Dict, Sequence

import numpy as np

# toy network ops (the "model" a fake runs): name -> (function on the input batch, output dtype)
TOY_OPS = {
    "sum_axis1": lambda x: x.astype(np.float32).sum(axis=1),  # (N, C, H, W) -> (N, H, W)
    "sum_last": lambda x: x.astype(np.float32).sum(axis=-1),  # (N, H, W, C) -> (N, H, W)
    "mean": lambda x: x.astype(np.float32).reshape(x.shape[0], -1).mean(axis=1, keepdims=True),  # -> (N, 1)
}


def toy_outputs(batch: np.ndarray, outputs: Sequence[Dict[str, str]]) -> list:
    """What a toy model file computes for ``batch``: one array per output, in its declared dtype."""
    return [TOY_OPS[o["op"]](batch).astype(o.get("dtype", "float32")) for o in outputs]


def write_toy_model(path: str, kind: str, input_shape: Sequence[int], input_dtype: str = "float32",
                    input_name: str = "images", outputs: Sequence[Dict[str, str]] = ({"op": "sum_axis1"},),
                    ) -> str:
    """Write a fake's model file (JSON, not a real .ms/.om): ``kind`` is ``mslite-toy`` or ``acl-toy``."""
    with open(path, "w") as f:
        json.dump({"fake_model": kind, "inputs": [{"name": input_name, "shape": list(input_shape),
                                                   "dtype": input_dtype}],
                   "outputs": [dict(o) for o in outputs]}, f)
    return path
