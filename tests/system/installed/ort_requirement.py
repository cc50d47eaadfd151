"""Print the wheel's onnxruntime requirement (its `ort` extra) for the running Python, e.g. onnxruntime==1.14.1.

Used by lane.sh to install onnxruntime as a box does (``--no-deps``) at the version the project names, read from
the built wheel rather than written a second time. pip's vendored packaging evaluates the markers.
"""

import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement


def main(wheel: str) -> int:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode("utf-8").splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist: onnxruntime"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and req.marker.evaluate({"extra": "ort"}):
            print("%s%s" % (req.name, req.specifier))
            return 0
    print("%s names no onnxruntime requirement for this Python in its ort extra" % wheel, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
