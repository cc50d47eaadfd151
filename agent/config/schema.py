"""A small typed-config layer: dataclasses in, per-field errors out.

Every config the project reads (daemon config, device configs, the bundle manifest, command payloads) is a
dataclass declared with :func:`setting`; :func:`parse` turns a mapping into it and collects *all* problems
before failing, each named by its dotted path (``mqtt.port``, ``sources[1].uri``). Unknown keys are errors, so
a typo fails loudly instead of being silently ignored (a reader of messages from newer peers may pass
``unknown="ignore"``). A number field takes only finite numbers: JSON parsers accept ``NaN`` and
``Infinity``, which pass every range comparison. Only the standard library is used, so the box
needs no extra dependency for this (typing_extensions on Python 3.7) and it runs on Python 3.7.
"""

import dataclasses
import math
import typing
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type, TypeVar

from agent._util.compat import Literal, get_args, get_origin

T = TypeVar("T")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str = "",
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    choices: Optional[Tuple[Any, ...]] = None,
    min_len: Optional[int] = None,
    factory: Any = dataclasses.MISSING,
) -> Any:
    """Declare a config field with its default, a one-line explanation and its bounds."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices, "min_len": min_len}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class FieldError(typing.NamedTuple):
    path: str
    message: str

    def __str__(self) -> str:
        return "%s: %s" % (self.path or "<root>", self.message)


class ConfigError(ValueError):
    """Raised with every problem found, not only the first."""

    def __init__(self, errors: List[FieldError], source: str = "") -> None:
        self.errors = list(errors)
        self.source = source
        head = "%s: " % source if source else ""
        count = len(self.errors)
        lines = ["%s%d error%s" % (head, count, "" if count == 1 else "s")]
        lines += ["  " + str(e) for e in self.errors]
        super().__init__("\n".join(lines))

    def as_list(self) -> List[Dict[str, str]]:
        """Structured form for MQTT acks: ``[{"field": ..., "message": ...}]``."""
        return [{"field": e.path, "message": e.message} for e in self.errors]


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return "%s[%d]" % (path, key)
    return "%s.%s" % (path, key) if path else str(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class _Parser:
    def __init__(self, ignore_unknown: bool = False) -> None:
        self.errors: List[FieldError] = []
        self.ignore_unknown = ignore_unknown

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def value(self, tp: Any, raw: Any, path: str) -> Any:  # noqa: C901 - one switch over supported types
        origin = get_origin(tp)
        args = get_args(tp)
        if tp is Any:
            return raw
        if dataclasses.is_dataclass(tp):
            return self.record(tp, raw, path)
        if origin is typing.Union:
            if raw is None and type(None) in args:
                return None
            inner = [a for a in args if a is not type(None)]
            if len(inner) == 1:
                return self.value(inner[0], raw, path)
            for candidate in inner:
                trial = _Parser(self.ignore_unknown)
                result = trial.value(candidate, raw, path)
                if not trial.errors:
                    return result
            self.fail(path, "expected one of %s, got %s" % ([_type_name(a) for a in inner], _short(raw)))
            return None
        if origin is Literal:
            if raw not in args:
                self.fail(path, "must be one of %s (got %s)" % (list(args), _short(raw)))
            return raw
        if origin in (list, List):
            if not isinstance(raw, (list, tuple)):
                self.fail(path, "expected a list, got %s" % _short(raw))
                return []
            return [self.value(args[0] if args else Any, item, _join(path, i)) for i, item in enumerate(raw)]
        if origin in (tuple, Tuple):
            if not isinstance(raw, (list, tuple)):
                self.fail(path, "expected a list, got %s" % _short(raw))
                return ()
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.value(args[0], item, _join(path, i)) for i, item in enumerate(raw))
            if len(raw) != len(args):
                self.fail(path, "expected %d items, got %d" % (len(args), len(raw)))
                return tuple(raw)
            return tuple(self.value(a, item, _join(path, i)) for i, (a, item) in enumerate(zip(args, raw)))
        if origin in (dict, Dict):
            if not isinstance(raw, Mapping):
                self.fail(path, "expected a mapping, got %s" % _short(raw))
                return {}
            key_t, val_t = args if args else (str, Any)
            return {self.value(key_t, k, path): self.value(val_t, v, _join(path, k)) for k, v in raw.items()}
        return self.scalar(tp, raw, path)

    def scalar(self, tp: Any, raw: Any, path: str) -> Any:
        # bool is an int subclass: a `true` must not pass as a port number, nor 1 as a flag.
        if tp is bool:
            if not isinstance(raw, bool):
                self.fail(path, "expected true or false, got %s" % _short(raw))
            return raw
        if tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                self.fail(path, "expected an integer, got %s" % _short(raw))
            return raw
        if tp is float:
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                self.fail(path, "expected a number, got %s" % _short(raw))
                return raw
            try:
                value = float(raw)
            except OverflowError:  # an integer beyond a float's range
                value = math.inf
            if not math.isfinite(value):
                self.fail(path, "expected a finite number, got %s" % _short(raw))
                return raw
            return value
        if tp is str:
            if not isinstance(raw, str):
                self.fail(path, "expected a string, got %s" % _short(raw))
            return raw
        if not isinstance(raw, tp):
            self.fail(path, "expected %s, got %s" % (_type_name(tp), _short(raw)))
        return raw

    def bounds(self, f: "dataclasses.Field[Any]", value: Any, path: str) -> None:
        meta = f.metadata
        if meta.get("choices") is not None and value not in meta["choices"]:
            self.fail(path, "must be one of %s (got %s)" % (list(meta["choices"]), _short(value)))
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric:
            if meta.get("ge") is not None and value < meta["ge"]:
                self.fail(path, "must be >= %s (got %s)" % (meta["ge"], value))
            if meta.get("gt") is not None and value <= meta["gt"]:
                self.fail(path, "must be > %s (got %s)" % (meta["gt"], value))
            if meta.get("le") is not None and value > meta["le"]:
                self.fail(path, "must be <= %s (got %s)" % (meta["le"], value))
        if meta.get("min_len") is not None and hasattr(value, "__len__") and len(value) < meta["min_len"]:
            self.fail(path, "must have at least %d item(s)" % meta["min_len"])

    def record(self, cls: Type[T], raw: Any, path: str) -> Optional[T]:
        if not isinstance(raw, Mapping):
            self.fail(path, "expected a mapping, got %s" % _short(raw))
            return None
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for key in raw:
            if key not in known and not self.ignore_unknown:
                self.fail(_join(path, key), "unknown key (known: %s)" % (", ".join(sorted(known)) or "none"))
        kwargs = {}
        before = len(self.errors)
        for name, f in known.items():
            fpath = _join(path, name)
            if name not in raw:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    self.fail(fpath, "required")
                continue
            field_before = len(self.errors)
            value = self.value(hints[name], raw[name], fpath)
            if len(self.errors) == field_before:
                self.bounds(f, value, fpath)
            kwargs[name] = value
        if len(self.errors) != before:
            return None
        instance = cls(**kwargs)
        check = getattr(instance, "check", None)
        if callable(check):
            for field_name, message in check():
                self.fail(_join(path, field_name), message)
        return instance


def parse(cls: Type[T], data: Any, source: str = "", unknown: str = "error") -> T:
    """Build ``cls`` from ``data`` or raise :class:`ConfigError` listing every bad field.

    A dataclass may define ``check(self) -> List[Tuple[field, message]]`` for cross-field rules; it runs only
    when every field parsed, so it can rely on types. ``unknown="ignore"`` skips keys the dataclasses do not
    declare (at every depth): for messages a newer peer may extend, never for a config or a command.
    """
    if unknown not in ("error", "ignore"):
        raise ValueError("unknown must be 'error' or 'ignore', got %r" % (unknown,))
    parser = _Parser(ignore_unknown=unknown == "ignore")
    result = parser.record(cls, data, "")
    if parser.errors:
        raise ConfigError(parser.errors, source)
    assert result is not None
    return result


def to_dict(instance: Any) -> Any:
    """The plain (JSON/YAML-ready) form of a parsed config; tuples become lists."""
    if dataclasses.is_dataclass(instance):
        return {f.name: to_dict(getattr(instance, f.name)) for f in dataclasses.fields(instance)}
    if isinstance(instance, (list, tuple)):
        return [to_dict(v) for v in instance]
    if isinstance(instance, dict):
        return {k: to_dict(v) for k, v in instance.items()}
    return instance


def load_yaml(cls: Type[T], path: str) -> T:
    """Read a YAML (or JSON) file into ``cls``; a syntax error is reported with the file name and line."""
    import yaml  # the box's one config dependency; imported here so schema stays usable without it

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError([FieldError("", "file not found")], path) from None
    except yaml.YAMLError as exc:
        raise ConfigError([FieldError("", "not valid YAML: %s" % exc)], path) from None
    return parse(cls, data if data is not None else {}, source=path)


def describe(cls: Type[Any], prefix: str = "") -> List[Tuple[str, str, str]]:
    """(path, default, doc) for every field: used by ``--help`` texts and docs generation."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = _join(prefix, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, path))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(to_dict(f.default_factory()))
        else:
            default = "(required)"
        rows.append((path, default, f.metadata.get("doc", "")))
    return rows
