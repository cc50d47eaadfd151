"""The suite's own rule: no test module imports another test module. Shared helpers live in helper modules
(conftest.py, daemon_rig.py, *_support.py), so running, moving or deleting one test file never changes another."""

import ast
import os
from typing import List, Tuple

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_test_modules(source: str) -> List[str]:
    """The test modules (``test_*``) that ``source`` imports, however it spells the import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + ["%s.%s" % (base, alias.name) if base else alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name.split(".")[-1].startswith("test_")
                  and name.split(".")[0] in ("tests", name)]
    return sorted(set(found))



def offenders() -> List[Tuple[str, List[str]]]:
    result = []
    for name in sorted(os.path.relpath(os.path.join(root, n), TESTS)
                       for root, _dirs, names in os.walk(TESTS) for n in names):
        if name.endswith(".py"):
            with open(os.path.join(TESTS, name), encoding="utf-8") as handle:
                imported = imported_test_modules(handle.read())
            if imported:
                result.append((name, imported))
    return result


def test_no_module_of_the_suite_imports_a_test_module():
    assert offenders() == [], "import the helper from a helper module instead: %s" % "; ".join(
        "%s imports %s" % (name, ", ".join(imported)) for name, imported in offenders())


def test_every_spelling_of_such_an_import_is_caught():
    planted = ("from tests.test_fetch import write\nimport test_outbox\nfrom tests import test_model_manager as m\n"
               "from test_fleet import bundles\nfrom tests.daemon_rig import ctl\nimport tests.test_watchdog\n")
    assert imported_test_modules(planted) == ["test_fleet", "test_outbox", "tests.test_fetch",
                                              "tests.test_model_manager", "tests.test_watchdog"]
    assert imported_test_modules("from tests.fleet_support import bundles\nimport pytest\n") == []
