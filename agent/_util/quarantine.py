"""Damaged state files are moved aside, never deleted and never fatal: the box must keep serving.

A power cut, a full disk or a hand edit can leave any state file the daemon owns unusable. The owner moves it
aside with a timestamp (evidence for a person), reports what was lost, and starts with an empty one.
"""

import logging
import os
import time
from typing import Any, Callable, Dict, Optional

logger = logging.getLogger(__name__)


def move_aside(path: str, reason: str, clock: Callable[[], float] = time.time) -> Optional[str]:
    """Rename ``path`` (and SQLite's ``-wal``/``-shm`` companions) to ``<path>.corrupt-<unix time>``.

    Returns the new path, or None when it could not be moved (read-only or vanished); the caller then
    degrades (for instance to an in-memory store) instead of exiting.
    """
    stamp = int(clock())
    aside = "%s.corrupt-%d" % (path, stamp)
    suffix = 0
    while os.path.exists(aside):  # two faults in one second must not overwrite the first one's evidence
        suffix += 1
        aside = "%s.corrupt-%d-%d" % (path, stamp, suffix)
    try:
        os.replace(path, aside)
    except OSError as exc:
        logger.error("%s is unusable (%s) and could not be moved aside: %s", path, reason, exc)
        return None
    for companion in ("-wal", "-shm"):
        if os.path.exists(path + companion):
            try:
                os.replace(path + companion, aside + companion)
            except OSError as exc:
                logger.warning("could not move %s aside: %s", path + companion, exc)
    logger.error("%s is unusable (%s); moved to %s", path, reason, aside)
    return aside


def state_alert(kind: str, message: str, **figures: Any) -> Dict[str, Any]:
    """An alert about a state file, shaped like the watchdog's (published on ``telemetry/alert``)."""
    return {"kind": kind, "message": message, "restart": False, "figures": figures}
