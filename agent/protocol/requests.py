"""One request type per verb: what each command's payload may hold, parsed by the schema engine.

The dispatcher parses a payload here before it accepts the command, so an unknown key, a wrong type or a
non-finite number is a failed ack ``invalid`` naming the field, and a handler only ever sees a typed request.
``request_id`` is the envelope (:mod:`agent.protocol.messages`), not part of any request.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from agent.config.schema import parse, setting
from agent.protocol.messages import VERBS

ENVELOPE_KEYS = ("request_id",)  # what every command carries beside its verb's fields


@dataclass(frozen=True)
class NoFields:
    """A verb that takes nothing but its request id (status, pause, resume, snapshot, restart)."""


@dataclass(frozen=True)
class ConfigRequest:
    """validate / set-config: a partial daemon config (``{"thresholds": {"conf": 0.4}}``) under ``config``."""

    config: Dict[str, Any] = setting(min_len=1, doc="the sections to change, each a partial section")


@dataclass(frozen=True)
class DeployRequest:
    bundle: str = setting(doc="bundle directory or .tar/.tar.gz inside the store, or an http(s) URL")
    sha256: str = setting(doc="sha256 (hex) of the bundle's manifest.json, as printed by 'bundle verify'")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if not self.bundle:
            problems.append(("bundle", "must not be empty"))
        if len(self.sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in self.sha256):
            problems.append(("sha256", "must be 64 hex digits (got %r)" % self.sha256[:80]))
        return problems


@dataclass(frozen=True)
class RollbackRequest:
    reason: Optional[str] = setting(None, min_len=1, doc="why, as events and the slot table show it "
                                    "(default: the operator's rollback command)")


REQUESTS: Dict[str, Type[Any]] = {
    "status": NoFields,
    "validate": ConfigRequest,
    "set-config": ConfigRequest,
    "deploy": DeployRequest,
    "rollback": RollbackRequest,
    "pause": NoFields,
    "resume": NoFields,
    "snapshot": NoFields,
    "restart": NoFields,
}
assert tuple(REQUESTS) == VERBS, "every verb has exactly one request type"


def parse_request(verb: str, payload: Mapping[str, Any]) -> Any:
    """The typed request of ``verb`` from a command's payload (envelope keys left out).

    Raises :class:`agent.config.schema.ConfigError` naming every bad field; KeyError for an unknown verb.
    """
    fields = {k: v for k, v in payload.items() if k not in ENVELOPE_KEYS}
    return parse(REQUESTS[verb], fields, verb)
