"""The aarch64 lane runs the box's own tests by marker (``-m box``, set by folder in tests/conftest.py): a new
box-side test module joins it without being listed, and every box-side group of agent/ has its folder there."""

import os
import shutil
import subprocess
import sys

from tests.conftest import BOX_TEST_FOLDERS, is_box_test

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
# agent/'s groups whose tests are not the box's: the command line (host commands too) and the operator's fleet side
NOT_BOX_GROUPS = {"cli", "fleet", "console"}


def test_a_new_module_in_a_box_folder_is_a_box_test_and_others_are_not():
    for folder in BOX_TEST_FOLDERS:
        assert is_box_test(os.path.join(TESTS, folder, "test_added_tomorrow.py")), folder
        assert is_box_test(os.path.join(TESTS, folder, "deeper", "test_x.py")), folder
    for elsewhere in ("unit/fleet/test_x.py", "unit/quant/test_x.py", "unit/cli/test_x.py", "system/daemon/test_x.py",
                      "project/test_x.py", "unit/pipelines/test_x.py", "unit/test_x.py"):
        assert not is_box_test(os.path.join(TESTS, elsewhere)), elsewhere


def test_every_box_side_group_of_agent_has_its_test_folder_in_the_lane():
    groups = sorted(name for name in os.listdir(os.path.join(REPO, "agent"))
                    if os.path.isfile(os.path.join(REPO, "agent", name, "__init__.py")))
    missing = [g for g in groups if g not in NOT_BOX_GROUPS and os.path.isdir(os.path.join(TESTS, "unit", g))
               and "unit/%s" % g not in BOX_TEST_FOLDERS]
    assert missing == [], "add unit/<group> to BOX_TEST_FOLDERS (tests/conftest.py) or NOT_BOX_GROUPS here"
    assert all(os.path.isdir(os.path.join(TESTS, folder)) for folder in BOX_TEST_FOLDERS)


def test_pytest_selects_a_module_added_to_a_box_folder(tmp_path):
    """A real collection: the suite's conftest over a tree with a module nobody listed, `-m box` as the lane runs it."""
    tests = tmp_path / "tests"
    (tests / "unit" / "pipeline").mkdir(parents=True)
    (tests / "unit" / "fleet").mkdir(parents=True)
    shutil.copy(os.path.join(TESTS, "conftest.py"), str(tests / "conftest.py"))
    (tests / "unit" / "pipeline" / "test_brand_new.py").write_text("def test_new():\n    pass\n")
    (tests / "unit" / "fleet" / "test_operator_side.py").write_text("def test_fleet():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=REPO)  # the copied conftest imports tests.support from the checkout
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "box", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tests)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert "unit/pipeline/test_brand_new.py::test_new" in done.stdout, done.stdout + done.stderr
    assert "test_operator_side" not in done.stdout
    assert "1/2 tests collected" in done.stdout, done.stdout
