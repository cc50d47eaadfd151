"""Sessions, CSRF tokens and the login throttle (agent/console/sessions.py), on a test clock."""

from agent.console.accounts import Account, Role
from agent.console.sessions import LOGIN_FAILURES, LOGIN_WINDOW_S, SESSION_IDLE_S, LoginThrottle, Sessions, csrf_ok

ANA = Account("ana", Role.OPERATOR, "$argon2id$unused")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_session_has_its_own_csrf_token_ends_at_logout_and_when_idle():
    clock = Clock()
    sessions = Sessions(clock)
    first, second = sessions.open(ANA), sessions.open(ANA)
    one, two = sessions.get(first), sessions.get(second)
    assert one.account == ANA and one.csrf != two.csrf and first != second
    assert csrf_ok(one, one.csrf) and not csrf_ok(one, two.csrf) and not csrf_ok(one, None)
    assert not csrf_ok(None, one.csrf)
    sessions.close(first)
    assert sessions.get(first) is None and sessions.get(second) is not None
    clock.now += SESSION_IDLE_S + 1
    assert sessions.get(second) is None
    assert sessions.get("made-up") is None and sessions.get(None) is None


def test_failed_logins_throttle_the_name_and_the_address_for_the_window():
    clock = Clock()
    throttle = LoginThrottle(clock)
    for _ in range(LOGIN_FAILURES - 1):
        throttle.failed("user:ana", "client:10.0.0.9")
    assert throttle.wait_s("user:ana", "client:10.0.0.9") == 0
    throttle.failed("user:ana", "client:10.0.0.9")
    assert throttle.wait_s("user:ana") == LOGIN_WINDOW_S
    assert throttle.wait_s("user:bob", "client:10.0.0.9") > 0  # the same address, another name
    assert throttle.wait_s("user:bob", "client:10.0.0.8") == 0
    clock.now += LOGIN_WINDOW_S + 1
    assert throttle.wait_s("user:ana", "client:10.0.0.9") == 0
