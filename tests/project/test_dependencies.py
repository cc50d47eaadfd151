"""The box's dependency floors exclude the releases with known CVEs, and the offline wheelhouse's pins
(constraints/box-py37.txt) satisfy every floor of pyproject.toml."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The first releases with the fixes docs/security.md names.
CVE_FLOORS = {"cryptography": "44.0.1", "opencv-python-headless": "4.8.1.78", "pyyaml": "5.4"}

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs tomllib (Python 3.11+)")
packaging_requirements = pytest.importorskip("packaging.requirements")


def _box_requirements():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    texts = project["dependencies"] + project["optional-dependencies"]["edge"]
    return [packaging_requirements.Requirement(t) for t in texts]


def _pins():
    pins = {}
    with open(os.path.join(REPO, "constraints", "box-py37.txt")) as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[name.lower().replace("_", "-")] = version
    return pins


def test_floors_exclude_the_releases_with_known_cves():
    checked = set()
    for requirement in _box_requirements():
        floor = CVE_FLOORS.get(requirement.name.lower())
        if floor is not None:
            assert not requirement.specifier.contains(_just_below(floor)), (requirement, floor)
            assert requirement.specifier.contains(floor), (requirement, floor)
            checked.add(requirement.name.lower())
    assert checked == set(CVE_FLOORS)


def _just_below(version):
    """A version just under ``version`` (4.8.1.78 -> 4.8.1.77), to show the floor excludes it."""
    parts = [int(p) for p in version.split(".")]
    for i in reversed(range(len(parts))):
        if parts[i] > 0:
            parts[i] -= 1
            return ".".join(str(p) for p in parts)
    raise ValueError(version)


def test_the_wheelhouse_pins_satisfy_every_box_requirement_for_python_3_7():
    pins = _pins()
    environment = {"python_version": "3.7", "python_full_version": "3.7.16", "sys_platform": "linux"}
    for requirement in _box_requirements():
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, "%s has no pin in constraints/box-py37.txt" % requirement
        assert requirement.specifier.contains(pins[name]), (requirement, pins[name])



def test_opencv_4_11_is_excluded_and_not_installed():
    """OpenCV 4.11.0 discards OPENCV_FFMPEG_CAPTURE_OPTIONS whenever it is set (docs/sources.md): a source's
    transport and input_options would silently never reach FFmpeg."""
    cv2 = pytest.importorskip("cv2")
    opencv = [r for r in _box_requirements() if r.name.lower() == "opencv-python-headless"]
    assert opencv and not opencv[0].specifier.contains("4.11.0.86"), opencv
    assert not cv2.__version__.startswith("4.11."), cv2.__version__
