"""`atlas-edge wheelhouse`: the box's pins for its Python and CPU, checked as the box would install them.

The checks of a folder run on generated wheels (no network). The Python 3.7 aarch64 wheelhouse of the Atlas 200 DK
is resolved for real when an index answers (it downloads ~100 MB once into a cache): every pin, onnxruntime 1.14.1.
"""

import os
import subprocess
import sys
import zipfile

import pytest

import agent.cli.wheelhouse as wheelhouse_module
from agent.cli.wheelhouse import (
    BOX_PYTHONS,
    WheelhouseError,
    build_wheelhouse,
    check_wheelhouse,
    platform_tags,
    read_pins,
    wheel_installs,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONSTRAINTS = os.path.join(REPO, "constraints")
CACHE = os.environ.get("ATLAS_EDGE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "atlas-edge"))


def fake_wheel(folder, filename, requires=()):
    name, version = filename.split("-")[:2]
    with zipfile.ZipFile(os.path.join(str(folder), filename), "w") as archive:
        metadata = "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s" % (
            name, version, "".join("Requires-Dist: %s\n" % r for r in requires))
        archive.writestr("%s-%s.dist-info/METADATA" % (name, version), metadata)


def test_platform_tags_cover_every_manylinux_up_to_the_box_glibc():
    assert platform_tags("aarch64", "2.27") == ["manylinux_2_%d_aarch64" % n for n in range(27, 16, -1)] + [
        "manylinux2014_aarch64"]
    with pytest.raises(WheelhouseError):
        platform_tags("aarch64", "2.12")


def test_a_wheel_installs_only_on_its_python_and_a_glibc_at_least_its_own():
    installs = wheel_installs
    assert installs("onnxruntime-1.14.1-cp37-cp37m-manylinux_2_27_aarch64.whl", "3.7.5", "aarch64", "2.27")
    assert not installs("onnxruntime-1.14.1-cp37-cp37m-manylinux_2_27_aarch64.whl", "3.7.5", "aarch64", "2.17")
    assert not installs("onnxruntime-1.14.1-cp37-cp37m-manylinux_2_27_x86_64.whl", "3.7.5", "aarch64", "2.27")
    assert not installs("numpy-2.0.2-cp39-cp39-manylinux2014_aarch64.whl", "3.7.5", "aarch64", "2.27")
    assert installs("opencv_python_headless-4.14.0.94-cp37-abi3-manylinux2014_aarch64.whl", "3.9.2", "aarch64", "2.31")
    assert not installs("cryptography-50.0.2-cp39-abi3-manylinux_2_28_aarch64.whl", "3.7.5", "aarch64", "2.27")
    assert installs("paho_mqtt-2.1.0-py3-none-any.whl", "3.7.5", "aarch64", "2.27")


def test_the_check_evaluates_markers_for_the_box_python_not_the_workstation(tmp_path):
    """cryptography needs typing_extensions below 3.11: a 3.11 workstation's pip would leave it out of a 3.9 box's."""
    fake_wheel(tmp_path, "atlas_edge-0.1.0-py3-none-any.whl", ["numpy>=1.19", 'cryptography>=44; extra == "edge"'])
    fake_wheel(tmp_path, "numpy-2.0.2-cp39-abi3-manylinux2014_aarch64.whl")  # abi3: installs on 3.9 and 3.11
    fake_wheel(tmp_path, "cryptography-50.0.2-cp39-abi3-manylinux_2_28_aarch64.whl",
               ['typing-extensions>=4.13.2; python_full_version < "3.11"'])
    pins = {"numpy": "2.0.2", "cryptography": "50.0.2"}
    with pytest.raises(WheelhouseError, match="typing-extensions>=4.13.2.*not in the folder"):
        check_wheelhouse(str(tmp_path), pins, "3.9.2", "aarch64", "2.31", roots=[("atlas-edge", "edge")])
    assert set(check_wheelhouse(str(tmp_path), pins, "3.11.2", "aarch64", "2.36", roots=[("atlas-edge", "edge")])) == {
        "atlas-edge", "numpy", "cryptography"}
    fake_wheel(tmp_path, "typing_extensions-4.15.0-py3-none-any.whl")
    with pytest.raises(WheelhouseError, match="typing_extensions-4.15.0-py3-none-any.whl is in the folder but not"):
        check_wheelhouse(str(tmp_path), pins, "3.9.2", "aarch64", "2.31", roots=[("atlas-edge", "edge")])
    pins["typing-extensions"] = "4.15.0"
    assert len(check_wheelhouse(str(tmp_path), pins, "3.9.2", "aarch64", "2.31", roots=[("atlas-edge", "edge")])) == 4


def test_a_pin_the_folder_lacks_or_has_at_another_version_fails(tmp_path):
    fake_wheel(tmp_path, "atlas_edge-0.1.0-py3-none-any.whl", ["numpy>=1.19"])
    fake_wheel(tmp_path, "numpy-1.21.6-cp37-cp37m-manylinux2014_aarch64.whl")
    with pytest.raises(WheelhouseError, match="onnxruntime==1.14.1 was not downloaded"):
        check_wheelhouse(str(tmp_path), {"numpy": "1.21.6", "onnxruntime": "1.14.1"}, "3.7.5", "aarch64", "2.27")
    with pytest.raises(WheelhouseError, match="pinned 1.21.5"):
        check_wheelhouse(str(tmp_path), {"numpy": "1.21.5"}, "3.7.5", "aarch64", "2.27")


@pytest.mark.parametrize("short", ["3.7", "3.9"])
def test_every_box_python_has_pins_for_the_box_side_onnxruntime_and_pip(short):
    pins = read_pins(os.path.join(CONSTRAINTS, "box-py%s.txt" % short.replace(".", "")))
    assert {"numpy", "opencv-python-headless", "paho-mqtt", "pyyaml", "cryptography", "onnxruntime", "pip"} <= set(pins)
    assert short in BOX_PYTHONS
    if short == "3.9":
        major, minor = (int(p) for p in pins["onnxruntime"].split(".")[:2])
        assert (major, minor) <= (1, 27), "onnxruntime 1.28+ crashes at import under qemu 7.2 (the aarch64 lane)"


def test_help_explains_the_command():
    done = subprocess.run([sys.executable, "-m", "agent", "wheelhouse", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    for words in ("--python", "--platform", "--out", "install.sh", "constraints/box-py", "no-index"):
        assert words in done.stdout, words


def _index_answers():
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                           os.path.join(CACHE, "probe"), "--python-version", "3.7", "--platform",
                           "manylinux2014_aarch64", "pip==24.0"], capture_output=True, timeout=120)
    return done.returncode == 0


def test_the_atlas_200dk_wheelhouse_resolves_completely_for_python_37_on_aarch64():
    """Download only: no aarch64 CPython 3.7 runs here. Cached in ~/.cache/atlas-edge (pip keeps wheels it has)."""
    if not _index_answers():
        pytest.skip("no package index answers (pip download of pip==24.0 for aarch64 failed)")
    out = os.path.join(CACHE, "wheelhouse-py37-aarch64")
    found = build_wheelhouse("3.7", "aarch64", out, source=REPO)
    pins = read_pins(os.path.join(CONSTRAINTS, "box-py37.txt"))
    assert set(found) == set(pins) | {"atlas-edge"}
    assert os.path.basename(found["onnxruntime"]) == "onnxruntime-1.14.1-cp37-cp37m-manylinux_2_27_aarch64.whl"
    assert all(wheel_installs(os.path.basename(p), "3.7.5", "aarch64", "2.27") for p in found.values())
    for required in ("numpy", "opencv-python-headless", "paho-mqtt", "pyyaml", "typing-extensions", "cryptography",
                     "cffi", "pycparser", "prometheus-client"):
        assert required in found, required
    with open(os.path.join(out, "install.sh")) as handle:
        script = handle.read()
    assert "--no-index" in script and "onnxruntime==1.14.1" in script and "python3.7" in script


def test_outside_a_checkout_it_names_the_options_that_say_where_the_pins_and_wheel_are(monkeypatch, tmp_path):
    # an installed wheel has no source tree: nothing is guessed from site-packages, the error names the options
    monkeypatch.setattr(wheelhouse_module, "checkout", lambda: None)
    with pytest.raises(WheelhouseError, match="no checkout here: pass --constraints"):
        build_wheelhouse("3.9", "aarch64", str(tmp_path / "out"), glibc="2.31")
    assert not (tmp_path / "out").exists()
