"""README's "What is where" table against the tree: every path it names exists, and every group of agent/ (a
directory with an ``__init__.py``) has a row. A moved module or a new group fails here, not in a reader's head."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
# A backticked name is a path when it looks like one: a folder (trailing /), a name with a '/', or a file
# name with one of these extensions. Commands (`atlas-edge bench`), keys and values (`cred:`) are not.
FILE_SUFFIXES = (".py", ".md", ".service", ".yaml", ".yml", ".json", ".toml", ".example", ".sh")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.@/-]+$")


def what_is_where(text):
    """[(path, what)] of the table under '## What is where'."""
    section = text.split("## What is where", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        rows.append((cells[0].strip("`"), "|".join(cells[1:])))
    return rows


def named_paths(what):
    return [name for name in re.findall(r"`([^`]+)`", what)
            if _PATHLIKE.match(name) and (name.endswith("/") or "/" in name or name.endswith(FILE_SUFFIXES))]


def resolves(row_path, name):
    """A name is relative to its row's folder (or the row file's folder), else to the repository root."""
    base = row_path if row_path.endswith("/") else os.path.dirname(row_path)
    return any(os.path.exists(os.path.join(REPO, root, name)) for root in (base, ""))


def agent_groups():
    agent = os.path.join(REPO, "agent")
    return sorted(name for name in os.listdir(agent)
                  if os.path.isfile(os.path.join(agent, name, "__init__.py")))


@pytest.fixture(scope="module")
def rows():
    with open(README, encoding="utf-8") as handle:
        found = what_is_where(handle.read())
    assert len(found) > 10, "README's 'What is where' table was not found"
    return found


def test_every_path_the_table_names_exists(rows):
    missing = [path for path, _what in rows if not os.path.exists(os.path.join(REPO, path))]
    missing += ["%s (in the row of %s)" % (name, path) for path, what in rows for name in named_paths(what)
                if not resolves(path, name)]
    assert missing == []


def test_every_group_of_agent_has_a_row(rows):
    listed = {path for path, _what in rows}
    assert [g for g in agent_groups() if "agent/%s/" % g not in listed] == []


def test_the_checks_see_a_missing_file_and_a_missing_row():
    """The control case: a table naming a file that is not there, and one without a group's row."""
    table = ("## What is where\n\n| path | what |\n|---|---|\n"
             "| `agent/ops/` | the transport (`transport.py`), the verbs (`commands.py`) |\n"
             "| `agent/config/` | the schema engine |\n\n## Next\n")
    rows = what_is_where(table)
    assert rows[0][0] == "agent/ops/" and named_paths(rows[0][1]) == ["transport.py", "commands.py"]
    assert [name for name in named_paths(rows[0][1]) if not resolves("agent/ops/", name)] == ["commands.py"]
    assert "bundle" in [g for g in agent_groups() if "agent/%s/" % g not in {p for p, _w in rows}]


def test_readme_and_operations_give_the_same_security_score():
    def scores(path):
        with open(os.path.join(REPO, path), encoding="utf-8") as handle:
            return re.findall(r"scores (?:the unit )?(\d+\.\d+)", " ".join(handle.read().split()))

    assert scores("README.md")[:1] == scores("docs/operations.md")[:1] != []
