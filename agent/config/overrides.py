"""Remote config changes (``set-config``) kept in the state directory, merged over the operator's file at start.

The unit makes ``/etc`` read-only (``ProtectSystem=strict``), and the operator's file carries their comments:
the daemon never rewrites it. A ``set-config`` is recorded in ``<state_dir>/overrides.json`` (written
atomically) and merged over the file at every start and SIGHUP, section by section, so a restart keeps it.

Two ways an overrides file can be unusable, handled differently:

* **damaged** (truncated, random bytes, JSON of the wrong shape): moved aside with a timestamp and reported;
  the daemon starts on the config file alone.
* **no longer valid** against a newer config file (say a threshold the new file's sources make invalid, or a
  section no longer live): that section is reported and ignored, the others still apply. It stays in the file
  until the next ``set-config`` rewrites it from the sections in effect.
"""

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent._util.atomic import atomic_write, private_mode
from agent._util.quarantine import move_aside, state_alert
from agent.config.daemon_config import DaemonConfig, load_daemon_config, merge_config, merge_sections
from agent.config.schema import ConfigError, parse, setting

log = logging.getLogger(__name__)

OVERRIDES_FILE = "overrides.json"
FORMAT_VERSION = 1  # bumped only with a migration; a file of another version is treated as damaged


@dataclass(frozen=True)
class OverridesDocument:
    """What ``overrides.json`` holds: ``{"version": 1, "changes": {"thresholds": {"conf": 0.4}}}``."""

    version: int = setting(choices=(FORMAT_VERSION,), doc="format of this file")
    changes: Dict[str, Any] = setting(factory=dict, doc="set-config changes in effect, by section")


@dataclass
class Overrides:
    """The overrides of one state directory: what is in effect, what was ignored, what was moved aside."""

    path: str
    changes: Dict[str, Any] = field(default_factory=dict)  # as read (or last written)
    applied: Dict[str, Any] = field(default_factory=dict)  # the sections that validated and are in effect
    ignored: List[Dict[str, Any]] = field(default_factory=list)  # {"section", "errors"} per rejected section
    damaged: Optional[str] = None  # why the file could not be used at all
    moved_to: Optional[str] = None  # where a damaged file went (None: not moved, e.g. validate's dry read)
    unreadable: Optional[str] = None  # why the file could not be read (permissions): not applied, not moved

    @classmethod
    def load(cls, path: str, quarantine: bool = True) -> "Overrides":
        """Read ``path`` (absent: no overrides). A damaged file is moved aside when ``quarantine``; ``atlas-edge
        validate`` passes False because checking a config must change nothing."""
        overrides = cls(path)
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            return overrides
        except OSError as exc:  # not damaged, unreadable to this user (validate run by a person): not moved
            overrides.unreadable = str(exc)
            log.error("overrides %s cannot be read, so they are not applied: %s", path, exc)
            return overrides
        try:
            document = parse(OverridesDocument, json.loads(raw.decode("utf-8")), source=path)
        except (ValueError, ConfigError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            overrides.damaged = _one_line(exc)
            if quarantine:
                overrides.moved_to = move_aside(path, overrides.damaged)
            log.error("overrides %s are damaged (%s); starting from the config file alone%s", path,
                      overrides.damaged, "; moved to %s" % overrides.moved_to if overrides.moved_to else "")
            return overrides
        overrides.changes = dict(document.changes)
        return overrides

    def apply(self, config: DaemonConfig) -> DaemonConfig:
        """``config`` with every section of the overrides that still validates against it; the rest is
        recorded in :attr:`ignored` and logged, never raised."""
        self.applied, self.ignored = {}, []
        result = config
        for section in sorted(self.changes):
            value = self.changes[section]
            try:
                result = merge_config(result, {section: value})
            except ConfigError as exc:
                self.ignored.append({"section": section, "errors": exc.as_list()})
                log.error("override of %s ignored: it does not validate against %s:\n%s", section,
                          "the config file", exc)
                continue
            self.applied[section] = value
        return result

    def record(self, changes: Mapping[str, Any]) -> Dict[str, Any]:
        """Merge a validated ``set-config`` change over the sections in effect and write the file atomically
        (durable before it returns). Returns the previous ``applied`` for :meth:`restore`."""
        previous = dict(self.applied)
        self._write(merge_sections(self.applied, changes))
        return previous

    def restore(self, previous: Mapping[str, Any]) -> None:
        """Put back what :meth:`record` replaced (the change could not be applied after all)."""
        self._write(dict(previous))

    def _write(self, changes: Dict[str, Any]) -> None:
        document = {"version": FORMAT_VERSION, "changes": changes}
        # A source's URI here may carry its password: never readable by others (0640 under umask 022).
        atomic_write(self.path, json.dumps(document, indent=1, sort_keys=True) + "\n", mode=private_mode())
        self.changes = dict(changes)
        self.applied = dict(changes)
        self.ignored = []

    def values(self) -> Dict[str, Any]:
        """Dotted path → value of each setting in effect that comes from the overrides (lists are whole)."""
        out: Dict[str, Any] = {}
        for section, value in sorted(self.applied.items()):
            if isinstance(value, Mapping):
                for key, inner in sorted(value.items()):
                    out["%s.%s" % (section, key)] = inner
            else:
                out[section] = value
        return out

    def alerts(self) -> List[Dict[str, Any]]:
        """What start-up found, as ``telemetry/alert`` messages (the shape the outbox and command record use)."""
        found = []
        if self.damaged:
            found.append(state_alert(
                "state_file_damaged", "overrides %s were unusable (%s)%s; remote set-config changes are lost, the "
                "config file alone is in effect" % (self.path, self.damaged,
                                                    " and were moved to %s" % self.moved_to if self.moved_to else ""),
                file=self.path, moved_to=self.moved_to, reason=self.damaged, lost="remote set-config changes"))
        if self.unreadable:
            found.append(state_alert(
                "state_file_unreadable", "overrides %s cannot be read (%s); remote set-config changes are not in "
                "effect" % (self.path, self.unreadable), file=self.path, reason=self.unreadable))
        for item in self.ignored:
            found.append(state_alert(
                "override_ignored", "override of %s in %s ignored: it does not validate against the config file"
                % (item["section"], self.path), file=self.path, section=item["section"], errors=item["errors"]))
        return found

    def report(self) -> Dict[str, Any]:
        """For ``status`` and ``validate``: the file, the values it sets, what was ignored or moved aside."""
        return {"file": self.path, "values": self.values(), "ignored": list(self.ignored),
                "damaged": self.damaged, "moved_to": self.moved_to, "unreadable": self.unreadable}


def overrides_path(config: DaemonConfig) -> str:
    return config.state_path(OVERRIDES_FILE)


def load_with_overrides(config_path: str, quarantine: bool = True) -> Tuple[DaemonConfig, Overrides]:
    """The config file (errors are fatal: ConfigError) with the state directory's overrides merged over it
    (problems there are reported, never fatal)."""
    config = load_daemon_config(config_path)
    overrides = Overrides.load(overrides_path(config), quarantine=quarantine)
    return overrides.apply(config), overrides


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300]
