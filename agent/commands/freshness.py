"""Fresh commands: ``issued_at`` and ``ttl_s`` judged on a clock that never runs backwards, every id kept until
its command expires, and (with a command key) an Ed25519 signature over what the command means.

A captured command must not run again later: the request record remembers only its newest entries, so an id
is also kept for as long as its command is valid (bounded in count by the dispatcher's rate limit, not by a
fixed size), in an :class:`IdStore`: in memory by default, in the request record's SQLite file once the
dispatcher hands it over (:meth:`Freshness.keep_ids_in`), so a replay within the validity is refused after a
restart too. A wall-clock step backwards must not make an expired command fresh again, so "now" is the wall
clock, but never less than the last "now" plus the monotonic time since (:class:`ForwardClock`).

The two halves are separate because the dispatcher runs them at different points: :meth:`Freshness.authenticate`
(the signature) before anything is looked up or written under the request id, so an unsigned sender can neither
pre-empt nor read the operator's ids; :meth:`Freshness.check_date` (date, validity, replay) after the request
record has answered a retry of a signed command it already knows.

The envelope fields (``issued_at``, ``ttl_s``, ``signature``) sit beside ``request_id`` in the payload; the
operator builds them with :mod:`agent.protocol.envelope`. A signature is the hex Ed25519 signature of
:func:`~agent.protocol.envelope.signed_bytes`: the target (device, or ``group/<name>``), the
verb, the request id, ``issued_at``, ``ttl_s`` and the verb's own fields, as canonical JSON. With a key set,
an unsigned, badly signed or undated command is refused; without one, a dated command is still judged.
"""

import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional

from agent._util.compat import Protocol
from agent.config.daemon_config import CommandsConfig
from agent.config.schema import ConfigError, FieldError
from agent.errors import CommandError
from agent.protocol.envelope import signed_bytes

DEFAULT_MAX_SKEW_S = 30.0  # how far apart the operator's and the box's clocks may be
DEFAULT_MAX_TTL_S = 3600.0  # the longest validity a command may claim


class ForwardClock:
    """Wall time that follows forward steps (NTP setting a box's clock at boot) but never goes backwards."""

    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.wall, self.mono = wall, mono
        self._last = wall()
        self._last_mono = mono()
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            mono = self.mono()
            now = max(self.wall(), self._last + (mono - self._last_mono))
            self._last, self._last_mono = now, mono
            return now


class IdStore(Protocol):
    """Where dated request ids are kept until their command expires (:class:`agent.commands.record.RequestRecord`)."""

    def claim_dated(self, request_id: str, expires: float, now: float) -> bool:
        """Keep ``request_id`` until ``expires``; False when it is already kept (forgetting what expired by ``now``)."""
        ...


class MemoryIds:
    """The in-memory :class:`IdStore` (a judge on its own, the tests): forgotten at a restart."""

    def __init__(self) -> None:
        self._seen: Dict[str, float] = {}  # request id -> when (forward clock) it may be forgotten
        self._lock = threading.Lock()

    def claim_dated(self, request_id: str, expires: float, now: float) -> bool:
        with self._lock:
            for old in [k for k, until in self._seen.items() if until < now]:
                del self._seen[old]
            if request_id in self._seen:
                return False
            self._seen[request_id] = expires
            return True


class Freshness:
    """Judges one command's date, signature and id; raises :class:`CommandError` naming what is wrong."""

    def __init__(self, public_key: Optional[bytes] = None, require_dated: bool = False,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S, max_ttl_s: float = DEFAULT_MAX_TTL_S,
                 clock: Optional[ForwardClock] = None) -> None:
        self.public_key = public_key
        self.require_dated = require_dated or public_key is not None
        self.max_skew_s, self.max_ttl_s = max_skew_s, max_ttl_s
        self.clock = clock or ForwardClock()
        self._ids: IdStore = MemoryIds()

    def keep_ids_in(self, store: IdStore) -> None:
        """Keep dated ids in ``store`` from now on (the dispatcher's persistent request record)."""
        self._ids = store

    def check(self, target: str, verb: str, message: Mapping[str, Any]) -> None:
        """The whole judgement: :meth:`authenticate`, then :meth:`check_date`."""
        self.authenticate(target, verb, message)
        self.check_date(message)

    def authenticate(self, target: str, verb: str, message: Mapping[str, Any]) -> bool:
        """True: signed with the command key; False: no key is set (nothing to check).

        With a key, raises ``unsigned`` or ``bad_signature``. One Ed25519 verification (tens of microseconds):
        cheap enough to run on every message before any rate limit or lookup.
        """
        if self.public_key is None:
            return False
        self._check_signature(target, verb, message)
        return True

    def check_date(self, message: Mapping[str, Any]) -> None:
        """``issued_at``/``ttl_s`` valid now, and the request id not used within its validity."""
        issued, ttl = message.get("issued_at"), message.get("ttl_s")
        if issued is None and ttl is None:
            if self.require_dated:
                raise CommandError("stale", "this box requires issued_at and ttl_s on every command",
                                   field="issued_at")
            return
        for name, value in (("issued_at", issued), ("ttl_s", ttl)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                    or value in (float("inf"), float("-inf")):
                raise CommandError("invalid", "%s must be a finite number (got %r)" % (name, value), field=name)
        if not 0 < ttl <= self.max_ttl_s:  # type: ignore[operator]
            raise CommandError("invalid", "ttl_s must be in (0, %g] (got %r)" % (self.max_ttl_s, ttl), field="ttl_s")
        now = self.clock.now()
        if issued > now + self.max_skew_s:  # type: ignore[operator]
            raise CommandError("stale", "issued_at is %.0f s ahead of this box's clock (more than the allowed skew "
                               "of %.0f s)" % (issued - now, self.max_skew_s), field="issued_at")  # type: ignore
        expires = issued + ttl + self.max_skew_s  # type: ignore[operator]
        if now > expires:
            raise CommandError("stale", "the command expired %.0f s ago (issued_at + ttl_s, with %.0f s of skew)"
                               % (now - expires, self.max_skew_s), field="issued_at")
        request_id = str(message.get("request_id"))
        if not self._ids.claim_dated(request_id, expires, now):
            raise CommandError("replayed", "request_id %s was already used within its validity" % request_id,
                               field="request_id")

    def _check_signature(self, target: str, verb: str, message: Mapping[str, Any]) -> None:
        signature = message.get("signature")
        if not isinstance(signature, str):
            raise CommandError("unsigned", "this box requires signed commands (signature)", field="signature")
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric import ed25519

        try:
            ed25519.Ed25519PublicKey.from_public_bytes(self.public_key).verify(  # type: ignore[arg-type]
                bytes.fromhex(signature), signed_bytes(target, verb, message))
        except (InvalidSignature, ValueError):
            raise CommandError("bad_signature", "the signature does not match the command and this box's "
                               "command key", field="signature") from None


def freshness_of(config: CommandsConfig) -> Freshness:
    """The daemon's judge from its ``commands:`` section; a bad key is a config error naming the field."""
    key = None
    if config.public_key:
        from agent.bundle.signing import load_public_key

        try:
            key = load_public_key(config.public_key)
        except (ValueError, OSError) as exc:
            raise ConfigError([FieldError("commands.public_key", str(exc))]) from None
    return Freshness(key, config.require_dated, config.max_skew_s, config.max_ttl_s)
