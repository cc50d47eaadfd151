"""The command envelope an operator puts around a verb's fields: a date (``issued_at``, ``ttl_s``) and, with a
command key, an Ed25519 ``signature``; the ``request_id`` beside them is the command's nonce.

Built here once for every sender (``ctl``, ``fleet``) and checked on the box against the same
:func:`signed_bytes` (:mod:`agent.commands.freshness`), so the operator's signer and the box's judge cannot
drift apart. A signature covers the target (a device id, or ``group/<name>``), the verb, the request id, the
date and the verb's fields as canonical JSON: it cannot be moved to another box, verb or time.
"""

import json
import time
from typing import Any, Callable, Dict, Mapping, Optional

from agent.protocol.requests import ENVELOPE_KEYS

DEFAULT_SIGNED_TTL_S = 300.0  # a signed command is dated; five minutes covers a slow broker and clock skew
MAX_TTL_S = 86400.0  # the operator's bound; a box refuses more than its commands.max_ttl_s (3600 by default)


def signed_bytes(target: str, verb: str, message: Mapping[str, Any]) -> bytes:
    """What a command's signature covers (the operator's signer and the box build it the same way)."""
    fields = {k: v for k, v in message.items() if k not in ENVELOPE_KEYS}
    body = {"target": target, "verb": verb, "request_id": message.get("request_id"),
            "issued_at": message.get("issued_at"), "ttl_s": message.get("ttl_s"), "fields": fields}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def group_target(group: str) -> str:
    """The target a command sent on a group's topic is signed for (and judged as on the box)."""
    return "group/%s" % group


def _private_key(pem: bytes, source: str) -> Any:
    """The Ed25519 private key in ``pem``; ValueError naming ``source`` when it is not one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: an encrypted key (no password is asked for)
        raise ValueError("%s is not an unencrypted PEM private key (%s)" % (source, exc)) from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError("%s is not an Ed25519 key (%s)" % (source, type(key).__name__))
    return key


def sign_command(private_key_pem: bytes, target: str, verb: str, message: Mapping[str, Any]) -> str:
    """The hex signature of a dated command (tests; senders use :class:`CommandEnvelope`)."""
    return _private_key(private_key_pem, "the command key").sign(signed_bytes(target, verb, message)).hex()


class CommandEnvelope:
    """How one operator command dates and signs what it sends; checked once, then :meth:`wrap` per publish.

    ``ttl_s`` None and no key: commands go undated (boxes without a command key accept that). A key without
    a ttl dates with :data:`DEFAULT_SIGNED_TTL_S`, since a box with a key requires dated commands.
    """

    def __init__(self, ttl_s: Optional[float] = None, key_pem: Optional[bytes] = None,
                 key_source: str = "--command-key", clock: Callable[[], float] = time.time) -> None:
        if key_pem is not None and ttl_s is None:
            ttl_s = DEFAULT_SIGNED_TTL_S
        if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:  # also refuses NaN: every comparison is False
            raise ValueError("--ttl must be in (0, %g] seconds (got %r)" % (MAX_TTL_S, ttl_s))
        self.ttl_s = ttl_s
        self._key = _private_key(key_pem, key_source) if key_pem is not None else None
        self.clock = clock

    @classmethod
    def from_file(cls, ttl_s: Optional[float], key_path: Optional[str]) -> "CommandEnvelope":
        """From the ``--ttl`` and ``--command-key FILE`` options; ValueError names what is wrong."""
        if key_path is None:
            return cls(ttl_s)
        try:
            with open(key_path, "rb") as handle:
                pem = handle.read()
        except OSError as exc:
            raise ValueError("--command-key %s: %s" % (key_path, exc.strerror or exc)) from None
        return cls(ttl_s, pem, "--command-key %s" % key_path)

    @property
    def signs(self) -> bool:
        return self._key is not None

    def wrap(self, target: str, verb: str, fields: Mapping[str, Any]) -> Dict[str, Any]:
        """``fields`` (with their ``request_id``) dated now and signed for ``target``; a new dict.

        Dated at each call: a command sent again (same request id) carries a fresh date and signature, so its
        validity runs from when it was last sent, and the box's record still answers a repeat without running it.
        """
        message = dict(fields)
        if self.ttl_s is not None:
            message.update(issued_at=self.clock(), ttl_s=self.ttl_s)
        if self._key is not None:
            message["signature"] = self._key.sign(signed_bytes(target, verb, message)).hex()
        return message
