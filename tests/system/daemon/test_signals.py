"""Signal handlers run on the main thread, which is the serving loop: they must take no lock the loop may hold."""

import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT

# The serving loop parks in stop_event.wait(), which holds the Event's condition lock for an instant on each
# wake-up; a SIGTERM that lands then must not try to take it again in the handler (a non-reentrant Lock).
CHILD = textwrap.dedent("""
    import os, signal, threading, types
    from agent.daemon import Daemon

    stopped = threading.Event()
    reloaded = threading.Event()
    fake_daemon = types.SimpleNamespace(request_stop=lambda reason, code: stopped.set(),
                                        _reload_requested=reloaded.set)
    Daemon.install_signal_handlers(fake_daemon)
    with stopped._cond, reloaded._cond:   # the loop inside Event.wait's critical section
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):           # the handlers run between these bytecodes
            pass
    print("handlers returned")
    print("relayed" if stopped.wait(10) and reloaded.wait(10) else "not relayed")
""")


def test_signal_handlers_only_relay_and_take_no_lock_of_the_interrupted_loop() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["handlers", "returned", "relayed"]
