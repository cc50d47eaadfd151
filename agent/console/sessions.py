"""Logged-in sessions, their CSRF tokens, and the login throttle.

Sessions live in the console's memory, keyed by a random id that is the cookie's only content (HttpOnly,
SameSite=Strict, Secure behind TLS): logging out or restarting the console ends them, and nothing about the user
travels to the browser. Each session has its own CSRF token, rendered into its forms and compared in constant time
on every state-changing request (the synchronizer-token pattern; SameSite=Strict alone is not relied on).

The throttle counts failed logins per user name and per client address: after :data:`LOGIN_FAILURES` in
:data:`LOGIN_WINDOW_S` both are refused until the window has passed, with the seconds left.
"""

import hmac
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Optional

from agent.console.accounts import Account

SESSION_IDLE_S = 8 * 3600.0  # a session unused this long is gone
SESSIONS_MAX = 10000  # the oldest are dropped beyond this: memory stays bounded whatever logs in
LOGIN_FAILURES = 5
LOGIN_WINDOW_S = 300.0
THROTTLE_KEYS_MAX = 10000


@dataclass
class Session:
    account: Account
    csrf: str
    last_used: float
    created: float = field(default=0.0)


class Sessions:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sessions: Dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, account: Account) -> str:
        """A new session for ``account``; its id (the cookie's value)."""
        now = self._clock()
        session_id = secrets.token_urlsafe(32)
        with self._lock:
            if len(self._sessions) >= SESSIONS_MAX:
                oldest = min(self._sessions, key=lambda key: self._sessions[key].last_used)
                del self._sessions[oldest]
            self._sessions[session_id] = Session(account, secrets.token_urlsafe(32), now, now)
        return session_id

    def get(self, session_id: Optional[str]) -> Optional[Session]:
        if not session_id:
            return None
        now = self._clock()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if now - session.last_used > SESSION_IDLE_S:
                del self._sessions[session_id]
                return None
            session.last_used = now
            return session

    def close(self, session_id: Optional[str]) -> None:
        with self._lock:
            self._sessions.pop(session_id or "", None)

    def __len__(self) -> int:
        return len(self._sessions)


def csrf_ok(session: Optional[Session], token: Optional[str]) -> bool:
    return session is not None and bool(token) and hmac.compare_digest(session.csrf, str(token))


class LoginThrottle:
    """Failed logins per key (a user name, a client address) in a sliding window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: Dict[str, Deque[float]] = {}
        self._lock = threading.Lock()

    def wait_s(self, *keys: str) -> float:
        """Seconds until a login under ``keys`` is tried again (0: now)."""
        now = self._clock()
        with self._lock:
            waits = [self._failures[key][0] + LOGIN_WINDOW_S - now for key in keys
                     if len(self._trim(key, now)) >= LOGIN_FAILURES]
        return max(waits, default=0.0)

    def failed(self, *keys: str) -> None:
        now = self._clock()
        with self._lock:
            if len(self._failures) >= THROTTLE_KEYS_MAX:
                self._failures = {k: v for k, v in self._failures.items() if self._trim(k, now)}
            for key in keys:
                self._failures.setdefault(key, deque(maxlen=LOGIN_FAILURES)).append(now)

    def succeeded(self, user_key: str) -> None:
        with self._lock:
            self._failures.pop(user_key, None)

    def _trim(self, key: str, now: float) -> Deque[float]:
        times = self._failures.get(key, deque())
        while times and now - times[0] > LOGIN_WINDOW_S:
            times.popleft()
        return times
