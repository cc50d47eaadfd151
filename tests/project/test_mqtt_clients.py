"""One module makes MQTT clients and their TLS: ``agent/ops/mqtt_client.py``. Anywhere else in agent/, a paho
``Client(...)`` or a ``tls_set``/``tls_set_context`` call is a second way to connect (issue 37: there were five
constructions and two TLS builders); the box's supervisor and the operator's link both go through the factory."""

import ast
import os
from typing import List, Set, Tuple

from conftest import REPO_ROOT

FACTORY = os.path.join("agent", "ops", "mqtt_client.py")
PAHO_CLIENT = "paho.mqtt.client"
TLS_CALLS = ("tls_set", "tls_set_context")


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner + "." + node.attr if inner else ""
    return ""


def mqtt_setups(source: str) -> List[Tuple[int, str]]:
    """(line, what) for each paho ``Client(...)`` construction and each TLS setup call in ``source``."""
    tree = ast.parse(source)
    modules: Set[str] = {PAHO_CLIENT}  # names bound to paho.mqtt.client
    classes: Set[str] = set()  # names bound to paho.mqtt.client.Client
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PAHO_CLIENT and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "paho.mqtt" and alias.name == "client":
                    modules.add(alias.asname or "client")
                elif node.module == PAHO_CLIENT and alias.name == "Client":
                    classes.add(alias.asname or "Client")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in classes or (name.endswith(".Client") and name[:-len(".Client")] in modules):
            found.append((node.lineno, "constructs %s" % name))
        elif isinstance(node.func, ast.Attribute) and node.func.attr in TLS_CALLS:
            found.append((node.lineno, "calls %s" % node.func.attr))
    return found


def agent_sources():
    for folder, _dirs, files in os.walk(os.path.join(REPO_ROOT, "agent")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, REPO_ROOT), path


def test_only_the_factory_module_makes_mqtt_clients_and_their_tls():
    elsewhere = []
    in_factory = []
    for relative, path in agent_sources():
        with open(path, encoding="utf-8") as handle:
            found = mqtt_setups(handle.read())
        if relative == FACTORY:
            in_factory = found
        else:
            elsewhere += ["%s:%d %s" % (relative, line, what) for line, what in found]
    assert elsewhere == [], "make MQTT clients with agent.ops.mqtt_client.new_client: %s" % elsewhere
    assert [what for _, what in in_factory] == ["constructs mqtt.Client", "calls tls_set_context"]


def test_a_planted_construction_or_tls_setup_is_found():
    planted = {
        "import paho.mqtt.client as mqtt\nc = mqtt.Client(client_id='x')\n": "constructs mqtt.Client",
        "import paho.mqtt.client as paho\nc = paho.Client()\n": "constructs paho.Client",
        "from paho.mqtt.client import Client as C\nc = C()\n": "constructs C",
        "from paho.mqtt import client\nc = client.Client()\n": "constructs client.Client",
        "import paho.mqtt.client\nc = paho.mqtt.client.Client()\n": "constructs paho.mqtt.client.Client",
        "def f(client, context):\n    client.tls_set_context(context)\n": "calls tls_set_context",
        "def f(client):\n    client.tls_set(ca_certs='ca.pem')\n": "calls tls_set",
    }
    for source, what in planted.items():
        assert [found for _, found in mqtt_setups(source)] == [what], source
    # what is not a paho client: another library's Client, a name that only looks like it
    assert mqtt_setups("import docker\nc = docker.Client()\nfrom http import client\nclient.HTTPConnection('x')") == []
