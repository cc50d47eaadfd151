"""Every state-changing action of the console, one JSON line each: who, what, on which target, when, and how it
ended (``--audit FILE``; appended, flushed and fsynced per line so a crash loses none that was answered).

Logins and logouts are recorded too, failed logins with the name tried (never the password).
"""

import json
import os
import threading
import time
from typing import Any, Dict, Optional


class AuditLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # opened once, 0600: it names who did what
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(descriptor, "a", encoding="utf-8")

    def record(self, user: Optional[str], action: str, target: Optional[str], result: str,
               detail: Optional[Dict[str, Any]] = None, client: Optional[str] = None) -> None:
        line = {"ts": round(time.time(), 3), "user": user, "action": action, "target": target, "result": result,
                "client": client}
        if detail:
            line["detail"] = detail
        with self._lock:
            self._file.write(json.dumps(line, sort_keys=True) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self._file.close()
