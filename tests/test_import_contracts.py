"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they do fail on a violating import.

The check runs on a copy of the packages in a temporary directory, so the violating import never touches the
tree; ``lint-imports`` comes from the dev extra (``make test`` runs it too).
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("agent", "quant", "converters", "benchmarks")

pytest.importorskip("importlinter", reason="import-linter is not installed (dev extra: pip install -e '.[dev]')")


def _python_only(directory, names):
    return [n for n in names if not (n.endswith(".py") or os.path.isdir(os.path.join(directory, n)))
            or n == "__pycache__"]


def copy_tree(tmp_path):
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), str(tmp_path / package), ignore=_python_only)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), str(tmp_path / "pyproject.toml"))
    return tmp_path


def lint_imports(root):
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=str(root), env=env,
                          capture_output=True, text=True, timeout=120)


def add_import(path, line):
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n%s  # a violation planted by the test\n" % line)


def test_the_tree_keeps_every_contract(tmp_path):
    result = lint_imports(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("agent/pipeline/batcher.py", "import agent.ops.transport", "pipeline and lifecycle never import ops"),
    ("agent/lifecycle/slots.py", "from agent.health import watchdog", "pipeline and lifecycle never import ops"),
    ("agent/health/sdnotify.py", "import agent.pipeline.stats", "health imports only config, _util and errors"),
    ("agent/pipeline/stats.py", "import quant", "what serves on the box never imports quant"),
    ("agent/pipeline/stats.py", "import mindspore", "what serves on the box never imports quant"),
])
def test_a_violating_import_breaks_its_contract(tmp_path, module, line, contract):
    root = copy_tree(tmp_path)
    add_import(str(root / module), line)
    result = lint_imports(root)
    assert result.returncode != 0
    assert "1 broken" in result.stdout, result.stdout
    report = result.stdout.split("Broken contracts", 1)[1]
    assert contract in report, result.stdout
    assert module.replace("/", ".")[:-3] + " -> " in report  # it names the offending import
