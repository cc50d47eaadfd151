"""The protocol's words are spelled in ``agent/protocol/`` only: no verb name, topic or event name literal
anywhere else in ``agent/`` (the box and the operator's side build them with ``agent.protocol.verbs``'
constants, ``agent.protocol.topics``' builders and ``agent.protocol.events.Event``, and read command topics with
``read_command_topic``).

The rule, as :func:`literals_in` applies it to the string constants of a module's syntax tree (``ast``; parts of
f-strings included), outside ``agent/protocol/``:

* **Never judged**: docstrings and other bare string statements; the values of ``help=``, ``description=``,
  ``epilog=`` and ``usage=``; the arguments of argparse's ``add_parser``/``add_argument``/``add_subparsers``/
  ``add_argument_group``/``ArgumentParser``. Prose may name a verb or a topic; only code that sends or reads
  one must take it from the protocol.
* **Topic fragments**: a string with a ``/`` that has a topic level of the protocol (``status``, ``cmd``,
  ``ack``, ``results``, ``telemetry``, ``alert``, ``events``, ``snapshot``, ``announce``, ``group``) as one
  of its ``/``-separated parts: ``"/status"``, ``".../status"``, ``"cmd/"``, ``"/ack/"``, ``"%s/%s/cmd/%s"``,
  ``"group/%s"``. An absolute path under a system directory (``/proc/self/status``) is a file, not a topic.
  A topic level alone (``"status"``, ``"results"``) is refused as an argument of a call whose name has ``topic``
  in it (``transport.topic("results", source)``, ``device_topic(prefix, "+", "status")``).
* **Verb names**, exact strings: ``deploy``, ``rollback``, ``set-config`` and ``snapshot`` mean nothing else
  in ``agent/``, so each is refused wherever it stands. The others are also ordinary words there (``status`` is
  a field of many messages and the fleet's own action, ``validate`` the ``atlas-edge validate`` command,
  ``restart`` an alert's flag and a rollback trigger, ``cancel`` and ``resume`` fleet actions, ``pause`` the
  serving loop's label for its own pause): they are refused where they are used as a verb, i.e. as the value of
  a ``verb=`` keyword or of a ``"verb"`` key, compared with or assigned to a name that contains ``verb``, as
  the index of such a name (``VERB_TABLE["status"]``), or as an argument of a protocol function that takes a
  verb (found by its parameter named ``verb``) or of a call named ``send``, ``command`` or ``request``.
* **Event names**: ``switched``, ``slots_reset``, ``bundle_moved_aside``, ``inference_error`` (and ``rollback``,
  above) wherever they stand; ``confirmed``, also a slot's state and a rollout's outcome, where it is used as an
  event: the value of an ``event=`` keyword or of an ``"event"`` key, compared with or assigned to a name that
  contains ``event``.

The checker is shown to catch a planted ``"deploy"`` and a planted ``".../status"`` in a file outside
``agent/protocol/`` (``test_the_checker_catches_...``), and to leave prose and ordinary words alone.
"""

import ast
import inspect
import os
import sys
from typing import Iterator, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "agent")

TOPIC_LEVELS = frozenset(("status", "cmd", "ack", "results", "telemetry", "alert", "events", "snapshot",
                          "announce", "group"))
SYSTEM_PATHS = ("/proc/", "/sys/", "/dev/", "/etc/", "/run/", "/var/", "/usr/", "/tmp/")
# Verbs whose name is used for nothing else in agent/: refused in any position.
VERBS_ONLY_AS_VERBS = frozenset(("deploy", "rollback", "set-config", "snapshot"))
# Event names used for nothing else in agent/ (agent.protocol.events.Event; "rollback" is a verb's too).
EVENTS_ONLY_AS_EVENTS = frozenset(("switched", "slots_reset", "bundle_moved_aside", "inference_error"))
PROSE_KEYWORDS = frozenset(("help", "description", "epilog", "usage"))
ARGPARSE_CALLS = frozenset(("add_parser", "add_argument", "add_subparsers", "add_argument_group",
                            "ArgumentParser"))
SENDING_CALLS = frozenset(("send", "command", "request"))

Problem = Tuple[str, int, str, str]  # (path, line, literal, why)


def _verbs() -> Set[str]:
    sys.path.insert(0, ROOT)
    from agent.protocol.verbs import verb_names

    return set(verb_names())


def _events() -> Set[str]:
    from agent.protocol.events import Event

    return {event.value for event in Event}


def _verb_taking_functions() -> Set[str]:
    """The names of agent.protocol's functions and methods that take a ``verb`` parameter."""
    from agent.protocol import envelope, messages, status, topics, verbs

    names = set()
    for module in (envelope, messages, status, topics, verbs):
        for name, member in vars(module).items():
            candidates = [(name, member)]
            if inspect.isclass(member):
                candidates += list(vars(member).items())
            for label, function in candidates:
                if callable(function) and not inspect.isclass(function):
                    try:
                        parameters = inspect.signature(function).parameters
                    except (TypeError, ValueError):
                        continue
                    if "verb" in parameters:
                        names.add(label)
    return names


def _string(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if sys.version_info < (3, 8) and isinstance(node, ast.Str):  # Python 3.7's parser (the Lite lane)
        return node.s
    return None


def _name(node: ast.AST) -> str:
    """The identifier a Name, an Attribute or a Call's callee ends with, else ''."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _strings(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` itself when it is a string, or the strings of a tuple, list or set literal."""
    if _string(node) is not None:
        yield node
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            if _string(element) is not None:
                yield element


def _is_topic_fragment(text: str) -> bool:
    if "/" not in text or text.startswith(SYSTEM_PATHS):
        return False
    return any(part in TOPIC_LEVELS for part in text.split("/"))


class _Checker:
    def __init__(self, path: str, verbs: Set[str], verb_calls: Set[str], events: Set[str]) -> None:
        self.path, self.verbs, self.verb_calls, self.events = path, verbs, verb_calls, events
        self.exempt: Set[int] = set()  # id() of string nodes that are prose
        self.as_verb: Set[int] = set()  # id() of string nodes used as a verb
        self.as_event: Set[int] = set()  # ... as an event's name
        self.as_level: Set[int] = set()  # ... as an argument of a topic builder
        self.problems: List[Problem] = []

    def run(self, tree: ast.AST) -> List[Problem]:
        for node in ast.walk(tree):
            self._classify(node)
        for node in ast.walk(tree):
            text = _string(node)
            if text is None or id(node) in self.exempt:
                continue
            line = getattr(node, "lineno", 0)
            if _is_topic_fragment(text) or (text in TOPIC_LEVELS and id(node) in self.as_level):
                self.problems.append((self.path, line, text, "a topic written by hand: build it with "
                                      "agent.protocol.topics"))
            elif text in VERBS_ONLY_AS_VERBS or (text in self.verbs and id(node) in self.as_verb):
                self.problems.append((self.path, line, text, "a verb written by hand: use agent.protocol.verbs' "
                                      "constant"))
            elif text in EVENTS_ONLY_AS_EVENTS or (text in self.events and id(node) in self.as_event):
                self.problems.append((self.path, line, text, "an event named by hand: use "
                                      "agent.protocol.events.Event"))
        return self.problems

    def _classify(self, node: ast.AST) -> None:  # noqa: C901 - one switch over the positions a string takes
        if isinstance(node, ast.Expr) and _string(node.value) is not None:
            self.exempt.add(id(node.value))  # a docstring, or a string statement
        elif isinstance(node, ast.Call):
            callee = _name(node)
            for keyword in node.keywords:
                if keyword.arg in PROSE_KEYWORDS:
                    self.exempt.update(id(s) for s in _strings(keyword.value))
                elif keyword.arg == "verb":
                    self.as_verb.update(id(s) for s in _strings(keyword.value))
                elif keyword.arg == "event":
                    self.as_event.update(id(s) for s in _strings(keyword.value))
            if "topic" in callee.lower():
                self.as_level.update(id(s) for arg in node.args for s in _strings(arg))
            if callee in ARGPARSE_CALLS:
                self.exempt.update(id(s) for arg in node.args for s in _strings(arg))
            elif callee in self.verb_calls or callee in SENDING_CALLS or "verb" in callee.lower():
                self.as_verb.update(id(s) for arg in node.args for s in _strings(arg))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if key is not None and _string(key) == "verb":
                    self.as_verb.update(id(s) for s in _strings(value))
                elif key is not None and _string(key) == "event":
                    self.as_event.update(id(s) for s in _strings(value))
        elif isinstance(node, ast.Compare):
            operands = [node.left] + list(node.comparators)
            if any("verb" in _name(o).lower() for o in operands):
                self.as_verb.update(id(s) for o in operands for s in _strings(o))
            if any("event" in _name(o).lower() for o in operands):
                self.as_event.update(id(s) for o in operands for s in _strings(o))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any("verb" in _name(t).lower() for t in targets):
                self.as_verb.update(id(s) for s in _strings(node.value))
            if node.value is not None and any("event" in _name(t).lower() for t in targets):
                self.as_event.update(id(s) for s in _strings(node.value))
        elif isinstance(node, ast.Subscript) and "verb" in _name(node.value).lower():
            index = node.slice
            if sys.version_info < (3, 9) and isinstance(index, ast.Index):  # 3.7/3.8 wrap the index
                index = index.value  # type: ignore[attr-defined]
            self.as_verb.update(id(s) for s in _strings(index))


def literals_in(source: str, path: str = "<source>") -> List[Problem]:
    """Every verb or topic literal of ``source`` that the rule above refuses."""
    return _Checker(path, _verbs(), _verb_taking_functions(), _events()).run(ast.parse(source))


def offenders(root: str = AGENT) -> List[Problem]:
    """The refused literals of every module under ``root`` (an ``agent/`` tree) but its ``protocol/``."""
    found: List[Problem] = []
    protocol = os.path.join(os.path.abspath(root), "protocol")
    for folder, _dirs, names in os.walk(root):
        if os.path.abspath(folder) == protocol or os.path.abspath(folder).startswith(protocol + os.sep):
            continue
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    found += literals_in(handle.read(), os.path.relpath(path, ROOT))
    return sorted(found)


def test_no_verb_or_topic_literal_outside_the_protocol():
    found = offenders()
    assert not found, "verb or topic literals outside agent/protocol/:\n" + "\n".join(
        "%s:%d %r: %s" % problem for problem in found)


@pytest.mark.parametrize("plant", [
    'VERB = None\n\ndef send_it(link):\n    link.publish(topic, "deploy")\n',
    'KIND = "deploy"\n',
    'def status_of(prefix, device):\n    return prefix + "/" + device + ".../status"\n',
    'TOPIC = "%s/%s/status"\n',
    'def own(prefix, device):\n    return "%s/%s/cmd/" % (prefix, device)\n',
    'ACK = f"{prefix}/{device}/ack/{rid}"\n',
    'def check(verb):\n    return verb == "status"\n',
    'def go(link):\n    link.send("cam-1", "pause", {})\n',
    'message = {"verb": "cancel", "request_id": "r1"}\n',
    'def go(transport, source):\n    return transport.topic("results", source)\n',
    'def watch(prefix):\n    return device_topic(prefix, "+", "status")\n',
    'SLOT_EVENTS = ("switched", "rollback")\n',
    'def seen(event):\n    return event.get("event") == "confirmed" or event_name == "confirmed"\n',
])
def test_the_checker_catches_a_planted_verb_or_topic_outside_the_protocol(tmp_path, plant):
    package = tmp_path / "agent" / "fleet"
    package.mkdir(parents=True)
    (package / "planted.py").write_text(plant, encoding="utf-8")
    found = offenders(str(tmp_path / "agent"))
    assert found and all(path.endswith("planted.py") for path, _line, _text, _why in found), (plant, found)


def test_the_same_plant_inside_the_protocol_is_its_business(tmp_path):
    package = tmp_path / "agent" / "protocol"
    package.mkdir(parents=True)
    (package / "topics.py").write_text('STATUS = "status"\nDEPLOY = "deploy"\nTOPIC = "%s/status"\n')
    assert offenders(str(tmp_path / "agent")) == []
    assert literals_in('DEPLOY = "deploy"\n')  # the same line elsewhere is refused


def test_prose_and_ordinary_words_are_left_alone():
    source = '''
"""Sends ``deploy`` to ``<prefix>/<device>/cmd/deploy`` and reads ``.../status``."""
import argparse, os

ACTIONS = ("status", "rollout", "resume", "cancel")


def main(command, alert, base):
    """Reads ``.../ack/<request_id>``."""
    parser = argparse.ArgumentParser(description="watch <prefix>/+/status")
    sub = parser.add_subparsers()
    sub.add_parser("status", help="every box's <prefix>/<device>/status")
    parser.add_argument("--group", help="send on <prefix>/group/<name>/cmd/<verb>")
    if command == "status" or alert.get("restart"):
        return {"status": "done", "restart": False}
    with open(os.path.join(base, "status")) as handle:
        handle.read()
    return open("/proc/self/status")
'''
    assert literals_in(source) == []
