"""The request types: what a command's payload may hold, parsed by the schema engine.

The verb table (:mod:`agent.protocol.verbs`) names each verb's type; the dispatcher parses a payload through
it (:func:`agent.protocol.verbs.parse_request`) before it accepts the command, so an unknown key, a wrong type
or a non-finite number is a failed ack ``invalid`` naming the field, and a handler only ever sees a typed
request. ``request_id`` is the envelope (:mod:`agent.protocol.messages`), not part of any request.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from agent.config.schema import setting

ENVELOPE_KEYS = ("request_id", "issued_at", "ttl_s", "signature")  # beside the verb's fields (see freshness)


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
    archive_sha256: Optional[str] = setting(None, doc="sha256 of the archive file itself, checked while it "
                                            "downloads, before it is opened; required for a URL")
    allow_downgrade: bool = setting(False, doc="deploy a release older than the confirmed one")
    allow_model_change: bool = setting(False, doc="deploy a model with another name than the confirmed one")

    def check(self) -> List[Tuple[str, str]]:
        return bundle_problems(self.bundle, self.sha256, self.archive_sha256)


def bundle_problems(bundle: str, sha256: str, archive_sha256: Optional[str]) -> List[Tuple[str, str]]:
    """What is wrong with a request's bundle reference (deploy and shadow fetch the same way)."""
    problems = []
    if not bundle:
        problems.append(("bundle", "must not be empty"))
    for name, value in (("sha256", sha256), ("archive_sha256", archive_sha256)):
        if value is not None and not _is_sha256(value):
            problems.append((name, "must be 64 hex digits (got %r)" % value[:80]))
    if "://" in bundle and archive_sha256 is None:
        problems.append(("archive_sha256", "required for a URL: the sha256 of the file downloaded, checked "
                         "before it is unpacked"))
    return problems


@dataclass(frozen=True)
class ShadowRequest:
    """A candidate bundle run beside the serving model on a sample of live frames, compared, never published.

    Fetched and verified as a deploy's bundle is; a later ``deploy`` of the same sha256 switches to it without a
    second download (docs/shadow.md)."""

    bundle: str = setting(doc="bundle directory or .tar/.tar.gz inside the store, or an http(s) URL")
    sha256: str = setting(doc="sha256 (hex) of the bundle's manifest.json, as printed by 'bundle verify'")
    archive_sha256: Optional[str] = setting(None, doc="sha256 of the archive file itself; required for a URL")
    sample: float = setting(1.0, gt=0.0, le=1.0, doc="share of the served frames offered to the candidate "
                            "(every 1/sample-th frame: a pattern, not chance)")
    frames: int = setting(200, ge=1, le=100000, doc="frames to compare before the run ends")
    max_s: float = setting(600.0, gt=0.0, le=86400.0, doc="seconds after which the run ends with what it "
                           "compared")

    def check(self) -> List[Tuple[str, str]]:
        return bundle_problems(self.bundle, self.sha256, self.archive_sha256)


@dataclass(frozen=True)
class ShadowStopRequest:
    discard: bool = setting(False, doc="also delete the candidate's files (else a deploy of it needs no "
                            "download)")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


@dataclass(frozen=True)
class RollbackRequest:
    reason: Optional[str] = setting(None, min_len=1, doc="why, as events and the slot table show it "
                                    "(default: the operator's rollback command)")


def request_fields(request: Any) -> Dict[str, Any]:
    """A request's fields as its command's JSON body holds them: a field left at its default is left out, so the
    box applies its own default (the same one, from the same type) and an old box never sees a key it lacks."""
    body = {}
    for field in dataclasses.fields(request):
        value = getattr(request, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        body[field.name] = value
    return body
