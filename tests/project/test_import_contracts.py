"""The import rules hold, and each one fails on a planted violation.

The contracts are in pyproject.toml ([tool.importlinter]); ``make test`` runs ``lint-imports`` too. Beside them,
the whole tree (agent, quant, converters, benchmarks) has no import circle between modules: import-linter's
layers order groups, a circle inside one group is what this file's own check finds. Every check runs on a copy
of the packages in a temporary directory, so a planted import never touches the tree; ``lint-imports`` comes
from the dev extra.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("agent", "quant", "converters", "benchmarks")

pytest.importorskip("importlinter", reason="import-linter is not installed (dev extra: pip install -e '.[dev]')")

# Prints every circle of imports between modules of the packages, one per line; exit 1 if any. An import under
# TYPE_CHECKING counts: it ties the two modules as much as any other (farm-studio counts it too).
CIRCLES = r"""
import sys
import grimp

graph = grimp.build_graph(*sys.argv[1:], exclude_type_checking_imports=False)
modules = sorted(graph.modules)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
index, low, on_stack, stack, circles = {}, {}, set(), [], []
for root in modules:  # Tarjan's strongly connected components, iteratively (no recursion limit)
    if root in index:
        continue
    work = [(root, 0)]
    while work:
        node, i = work.pop()
        if i == 0:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
        if i < len(edges[node]):
            work.append((node, i + 1))
            nxt = edges[node][i]
            if nxt not in index:
                work.append((nxt, 0))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
            continue
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[node])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))
for circle in circles:
    print(" <-> ".join(circle))
sys.exit(1 if circles else 0)
"""


def _python_only(directory, names):
    return [n for n in names if not (n.endswith(".py") or os.path.isdir(os.path.join(directory, n)))
            or n == "__pycache__"]


def copy_tree(tmp_path):
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), str(tmp_path / package), ignore=_python_only)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), str(tmp_path / "pyproject.toml"))
    return tmp_path


def _run(root, code, *args):
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=str(root), env=env, capture_output=True,
                          text=True, timeout=180)


def lint_imports(root):
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return _run(root, code, "--no-cache")


def circles(root):
    return _run(root, CIRCLES, *PACKAGES)


def add_import(path, line):
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n%s  # a violation planted by the test\n" % line)


def test_the_tree_keeps_every_contract_and_has_no_import_circle(tmp_path):
    root = copy_tree(tmp_path)
    result = lint_imports(root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
    found = circles(root)
    assert found.returncode == 0, "import circles:\n" + found.stdout + found.stderr


LAYERS = "agent's groups in layers"
HOST = "the workstation's packages sit between"
FLEET = "fleet and console (the operator's side)"
BOX = "what serves on the box never imports"


@pytest.mark.parametrize("module, line, contract", [
    # the two holes the old per-group lists left: fleet was in none of them
    ("agent/config/secrets.py", "import agent.fleet.link", LAYERS),
    ("agent/pipeline/stats.py", "import agent.fleet.status", LAYERS),
    ("agent/pipeline/batcher.py", "import agent.lifecycle.slots", LAYERS),
    ("agent/bundle/verify.py", "import agent.pipeline.stats", LAYERS),
    ("agent/config/schema.py", "import agent.protocol.messages", LAYERS),
    ("agent/ops/transport.py", "import agent.health.sdnotify", LAYERS),  # siblings across '|'
    ("agent/_util/disk.py", "import agent.errors", LAYERS),
    ("converters/aipp.py", "import quant.config", HOST),
    ("converters/byom/create.py", "import quant.export", HOST),  # bundle create shares qat's writer from below
    ("quant/config.py", "import agent.cli.main", HOST),
    ("agent/fleet/link.py", "import agent.pipeline.stats", FLEET),
    ("agent/pipeline/stats.py", "import quant", BOX),
    ("agent/lifecycle/slots.py", "import mindspore", BOX),
])
def test_a_violating_import_breaks_its_contract(tmp_path, module, line, contract):
    root = copy_tree(tmp_path)
    assert os.path.isfile(str(root / module)), module
    add_import(str(root / module), line)
    result = lint_imports(root)
    assert result.returncode != 0
    assert "1 broken" in result.stdout, result.stdout
    report = result.stdout.split("Broken contracts", 1)[1]
    assert contract in report, result.stdout
    assert module.replace("/", ".")[:-3] in report  # it names the offending module


def test_a_group_left_out_of_the_layers_breaks_them(tmp_path):
    root = copy_tree(tmp_path)
    os.mkdir(str(root / "agent" / "newgroup"))
    (root / "agent" / "newgroup" / "__init__.py").write_text('"""A group nobody placed."""\n')
    result = lint_imports(root)
    assert result.returncode != 0 and "1 broken" in result.stdout, result.stdout
    assert "agent.newgroup" in result.stdout.split("Broken contracts", 1)[1]


@pytest.mark.parametrize("first, second", [
    ("quant/config.py", "quant/export.py"),
    ("agent/fleet/plan.py", "agent/fleet/journal.py"),
])
def test_a_planted_circle_is_found(tmp_path, first, second):
    root = copy_tree(tmp_path)
    name = lambda path: path.replace("/", ".")[:-3]  # noqa: E731
    add_import(str(root / first), "import %s" % name(second))
    add_import(str(root / second), "import %s" % name(first))
    found = circles(root)
    assert found.returncode == 1
    assert name(first) in found.stdout and name(second) in found.stdout, found.stdout
