"""The suite's own rules: no test module imports another test module (shared helpers live in helper modules:
conftest.py, daemon_rig.py, *_support.py, so running, moving or deleting one test file never changes another);
every code folder has its test folder under tests/unit/ and no test folder outlives its code; tests/README.md
names every folder of test modules, every module in it, and every helper module of support/."""

import ast
import os
import re
from typing import Dict, List, Tuple

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


# --- the suite mirrors the code, and tests/README.md says what is where ------------------------------------------

REPO = os.path.dirname(TESTS)
HOST_PACKAGES = ("quant", "converters", "benchmarks")  # the workstation's packages: tests/unit/<name>/ each


def code_folders(repo: str) -> List[str]:
    """The folders tests mirror, as their tests/unit/ path: every package under agent/ (``agent/pipeline/sources``
    is ``pipeline/sources``), and each host package by its name."""
    found = []
    for root, dirs, names in os.walk(os.path.join(repo, "agent")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(root, os.path.join(repo, "agent"))
        if rel != "." and "__init__.py" in names:
            found.append(rel.replace(os.sep, "/"))
    found += [name for name in HOST_PACKAGES if os.path.isfile(os.path.join(repo, name, "__init__.py"))]
    return sorted(found)


def modules_of(folder: str) -> List[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.startswith("test_") and n.endswith(".py"))


def unit_folders(repo: str) -> List[str]:
    """tests/unit/'s folders that hold test modules, relative to it."""
    unit = os.path.join(repo, "tests", "unit")
    return sorted(os.path.relpath(root, unit).replace(os.sep, "/") for root, _dirs, names in os.walk(unit)
                  if root != unit and any(n.startswith("test_") and n.endswith(".py") for n in names))


def mirror_faults(repo: str) -> List[str]:
    """A code folder without test modules in its tests/unit/ folder, and a tests/unit/ folder no code folder has."""
    code, tested = code_folders(repo), unit_folders(repo)
    return (["%s has no tests/unit/%s/ with test modules" % (c if c in HOST_PACKAGES else "agent/" + c, c)
             for c in code if c not in tested] +
            ["tests/unit/%s/ mirrors no code folder (moved or renamed?)" % t for t in tested if t not in code])


def test_every_code_folder_has_its_test_folder_and_no_test_folder_is_stale():
    assert mirror_faults(REPO) == []


def test_the_mirror_rule_catches_a_missing_and_a_stale_test_folder(tmp_path):
    for package in ("agent/pipeline/sources", "agent/fleet", "quant"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "agent" / "pipeline" / "__init__.py").write_text("")
    for folder in ("pipeline", "fleet", "quant", "sources"):
        (tmp_path / "tests" / "unit" / folder).mkdir(parents=True)
        (tmp_path / "tests" / "unit" / folder / "test_x.py").write_text("")
    assert mirror_faults(str(tmp_path)) == ["agent/pipeline/sources has no tests/unit/pipeline/sources/ with test "
                                            "modules", "tests/unit/sources/ mirrors no code folder (moved or "
                                            "renamed?)"]


def readme_rows(text: str) -> Dict[str, List[str]]:
    """tests/README.md's table: {folder: the module names its row gives}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[0].endswith("/`"):
            rows[cells[0].strip("`")] = re.findall(r"[A-Za-z0-9_]+\.py\b", "|".join(cells[1:]))
    return rows


def readme_faults(tests: str, text: str) -> List[str]:
    """What tests/README.md's table gets wrong: a folder with test modules and no row; a row's module that is not
    in its folder; a row that lists modules but misses one of its folder's test modules; a helper module of
    support/ it does not name."""
    rows = readme_rows(text)
    faults = []
    folders = sorted(os.path.relpath(root, tests).replace(os.sep, "/") + "/"
                     for root, dirs, names in os.walk(tests) if root != tests and modules_of(root))
    faults += ["no row for %s" % f for f in folders if f not in rows]
    for folder, named in sorted(rows.items()):
        here = os.path.join(tests, folder)
        faults += ["%s names %s, which is not there" % (folder, n) for n in named
                   if not os.path.isfile(os.path.join(here, n))]
        if named:
            faults += ["%s does not name %s" % (folder, n) for n in modules_of(here) if n not in named]
    support = os.path.join(tests, "support")
    modules = sorted(n for n in os.listdir(support) if n.endswith(".py") and n != "__init__.py")
    faults += ["support/ does not name %s" % n for n in modules if n not in rows.get("support/", [])]
    return faults


def test_the_readme_of_the_suite_names_every_folder_and_module():
    with open(os.path.join(TESTS, "README.md"), encoding="utf-8") as handle:
        assert readme_faults(TESTS, handle.read()) == []


def test_the_readme_rule_catches_a_missing_row_a_stale_name_and_an_unnamed_module(tmp_path):
    for name in ("unit/ops/test_a.py", "unit/ops/test_b.py", "unit/cli/test_c.py", "support/x_support.py",
                 "support/rig.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    table = ("| folder | what |\n|---|---|\n| `support/` | x_support.py |\n"
             "| `unit/ops/` | test_a.py, test_gone.py |\n")
    assert readme_faults(str(tmp_path), table) == [
        "no row for unit/cli/", "unit/ops/ names test_gone.py, which is not there", "unit/ops/ does not name test_b.py",
        "support/ does not name rig.py"]
