"""Reading the shipped systemd unit (a helper module, not a test module): the unit's tests and the tests that
run the daemon under it parse it the same way."""

import os
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(ROOT, "systemd", "atlas-edge.service")


def directives(text: str) -> Dict[str, Dict[str, List[str]]]:
    """section -> key -> values in order (systemd allows a key many times, e.g. DeviceAllow=)."""
    sections: Dict[str, Dict[str, List[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, "directive outside a section: %r" % line
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(section: Dict[str, List[str]], key: str) -> str:
    values = section[key]
    assert len(values) == 1, "%s given %d times" % (key, len(values))
    return values[0]
