"""The int8 artifacts' outputs on a bundle's golden cases, with plain onnxruntime and one thread: run by the aarch64
lane under ``qemu-x86_64 -cpu Haswell-noTSX`` (an x86 without VNNI, where onnxruntime's u8s8 kernels add pairs of
products in 16 bits) and judged there against the outputs this machine wrote into the bundle. A script, not a test
module; it needs only numpy and onnxruntime.

    python tests/system/arm64/int8_outputs.py BUNDLE OUT    # writes OUT/case<i>.<artifact>.npy
"""

import json
import os
import sys

import numpy as np
import onnxruntime


def main(bundle: str, out: str) -> int:
    with open(os.path.join(bundle, "manifest.json")) as handle:
        manifest = json.load(handle)
    int8 = {a["file"] for a in manifest["artifacts"] if a["precision"] == "int8" and a["format"] == "onnx"}
    os.makedirs(out, exist_ok=True)
    sessions = {}
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    for index, case in enumerate(manifest["golden"]["cases"]):
        image = np.load(os.path.join(bundle, case["image"]))
        for file in sorted(set(case["expected"]) & int8):
            if file not in sessions:
                sessions[file] = onnxruntime.InferenceSession(os.path.join(bundle, file), options,
                                                              providers=["CPUExecutionProvider"])
            session = sessions[file]
            output = session.run(None, {session.get_inputs()[0].name: image[None]})[0]
            np.save(os.path.join(out, "case%d.%s.npy" % (index, file)), output)
            print("case %d %s: %s" % (index, file, output.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
