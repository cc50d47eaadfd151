"""Child processes: stop them the same way everywhere (the embedded broker, the start-up benchmark)."""

import logging
import signal
import subprocess
from typing import Optional

logger = logging.getLogger(__name__)


def terminate(process: "subprocess.Popen[bytes]", timeout: float, name: str) -> Optional[int]:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (None if it would not die)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", name, process.pid, timeout)
            process.kill()
            process.wait(timeout)
    return process.returncode
