#!/usr/bin/env bash
# The installed-wheel lane (`make test-wheel`): the box as a user installs it, never the tree's modules.
#
#   tests/system/installed/lane.sh PYTHON      PYTHON: the interpreter to install for (3.11; the box's 3.7)
#
# 1. the tree as a fresh clone holds it (tracked and new files, nothing ignored) is copied to a work dir under
#    /tmp and built into a wheel there (no build/ left over from earlier builds can leak into it);
# 2. a new venv under /tmp gets the wheel with the `edge` extra, onnxruntime without its dependencies (as a box
#    installs it) and the test runner, offline from a wheelhouse cached per Python in $ATLAS_EDGE_CACHE
#    (~/.cache/atlas-edge), filled from the index on its first run;
# 3. tests/ is copied next to it and pytest runs from an empty directory with an ini file of its own (no
#    `pythonpath = .` of the checkout): tests/system/installed plus the box's end-to-end tests, against site-packages.
set -euo pipefail
PY=${1:?usage: tests/system/installed/lane.sh PYTHON}
# nothing from a checkout on the import path (the editable venvs' PYTHONPATH=$PWD habit); the tests here fail,
# not skip, if agent still does not come from site-packages
unset PYTHONPATH
export ATLAS_EDGE_WHEEL_LANE=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
CACHE=${ATLAS_EDGE_CACHE:-$HOME/.cache/atlas-edge}
BOX_TESTS=(tests/system/installed tests/system/daemon/test_e2e.py tests/unit/health/test_sdnotify.py
           tests/system/daemon/test_metrics_endpoint.py)
WORK=$(mktemp -d /tmp/atlas-edge-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

TAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEELHOUSE=$CACHE/wheelhouse-lane-$TAG
echo "== wheel lane on $("$PY" --version 2>&1) in $WORK"

mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run" "$WHEELHOUSE"
(cd "$REPO" && git ls-files -z -c -o --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
"$PY" -m venv "$WORK/venv"
V=$WORK/venv/bin
# setuptools >= 61 reads pyproject.toml: the build backend comes from the wheelhouse too
REQS=("setuptools>=61" wheel "pytest>=7" "hypothesis>=6")
install() { "$V/pip" install -q --disable-pip-version-check --no-index --find-links "$WHEELHOUSE" "$@"; }
fill() { "$V/pip" download -q --disable-pip-version-check --dest "$WHEELHOUSE" "$@"; }
install "${REQS[@]}" 2>/dev/null || { fill "${REQS[@]}" && install "${REQS[@]}"; }
"$V/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK/dist"/atlas_edge-*.whl)
# `pip download` of the wheel copies it into the wheelhouse, and a later fill reuses that copy by its name: an
# older tree's wheel (same version, other extras) must never stand in for this one
rm -f "$WHEELHOUSE"/atlas_edge-*.whl
# The metrics extra too: the Prometheus endpoint test scrapes the installed daemon (docs/metrics.md)
install "$WHEEL[edge,metrics]" 2>/dev/null || { fill "$WHEEL[edge,metrics]" && install "$WHEEL[edge,metrics]"; }
# The onnxruntime backend as a box installs it: the wheel's own `ort` requirement for this Python, without its
# dependencies (inference needs numpy only); the box's tests then serve on it (cpu-dev prefers it).
ORT=$("$V/python" "$WORK/src/tests/system/installed/ort_requirement.py" "$WHEEL")
install --no-deps "$ORT" 2>/dev/null || { fill --no-deps "$ORT" && install --no-deps "$ORT"; }

mkdir "$WORK/t"
cp -a "$WORK/src/tests" "$WORK/t/tests"
cp -a "$WORK/src/docs" "$WORK/t/docs"  # the metrics test checks the series docs/metrics.md lists
cat > "$WORK/t/pytest.ini" <<'EOF'
[pytest]
# the copy's own tests package (tests.lite_support, conftest), never the checkout: agent comes from site-packages
pythonpath = .
addopts = -ra -p no:cacheprovider
markers =
    slow: long runs, not in this lane
EOF
cd "$WORK/run"
set +e
"$V/python" -m pytest -c "$WORK/t/pytest.ini" --rootdir "$WORK/t" -m "not slow" -q \
    "${BOX_TESTS[@]/#/$WORK/t/}"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "wheel lane: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
