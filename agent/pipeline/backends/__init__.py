"""Inference backends, found rather than hard-wired: a registry from name to backend class.

Like Frigate's detector registry, every plugin module is imported here and an ImportError in one is logged
and recorded instead of breaking the others. Our plugin modules import only numpy at module level (each
imports its runtime inside ``load()``), so this package imports on any box; what a box lacks is reported by
:func:`backend_status` without importing anything heavy, and by :class:`BackendUnavailable` at load.

The names come from ``agent.config.device_config.BACKEND_FORMATS`` (mindspore, onnxruntime, opencv, mslite,
acl): backend ``<name>`` lives in ``agent/pipeline/backends/<name>_backend.py`` as the :class:`Backend`
subclass whose ``name`` is ``<name>``. A new backend is one entry there and one new file here.
"""

import importlib
import logging
from typing import Any, Collection, Dict, Mapping, Optional, Sequence, Tuple

from agent.config.device_config import BACKEND_FORMATS
from agent.pipeline.backends.base import (
    Backend,
    BackendError,
    BackendOptions,
    BackendUnavailable,
    TensorSpec,
    artifact_format,
)

logger = logging.getLogger(__name__)

# name -> plugin module; the order is the order status is reported in
_PLUGINS: Tuple[Tuple[str, str], ...] = tuple((name, "%s.%s_backend" % (__name__, name)) for name in BACKEND_FORMATS)


def _backend_class(module: object, name: str) -> type:
    """The module's :class:`Backend` subclass named ``name`` (a plugin may import other backends' classes)."""
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Backend) and getattr(value, "name", None) == name:
            return value
    raise ImportError("%s defines no Backend subclass with name = %r" % (getattr(module, "__name__", module), name))


def _discover() -> Tuple[Dict[str, type], Dict[str, str]]:
    found: Dict[str, type] = {}
    errors: Dict[str, str] = {}
    for name, module in _PLUGINS:
        try:
            found[name] = _backend_class(importlib.import_module(module), name)
        except ImportError as err:
            errors[name] = "plugin %s failed to import: %s" % (module, err)
            logger.warning("backend %s disabled: %s", name, errors[name])
    return found, errors


BACKENDS, PLUGIN_ERRORS = _discover()  # name -> class; name -> why its module failed to import


def create_backend(name: str, artifact_path: str, input_spec: TensorSpec,
                   options: Optional[BackendOptions] = None) -> Backend:
    """A new, not yet loaded backend; call ``load()`` (or use it as a context manager)."""
    if name in PLUGIN_ERRORS:
        raise BackendUnavailable("backend %s is unavailable: %s" % (name, PLUGIN_ERRORS[name]))
    if name not in BACKENDS:
        raise ValueError("unknown backend %r (known: %s)" % (name, ", ".join(sorted(BACKENDS))))
    return BACKENDS[name](artifact_path, input_spec, options)


def pick_backend(preferred: str, fallbacks: Sequence[str], preferred_format: str,
                 served: Optional[Collection[str]] = None, status: Optional[Dict[str, str]] = None,
                 serve_formats: Optional[Mapping[str, Collection[str]]] = None) -> str:
    """The backend a box runs: the first of ``preferred`` + ``fallbacks`` whose runtime imports and that has
    something to serve. With ``served`` (the formats of the bundle's serve artifacts for this box) the
    preferred backend needs its own ``preferred_format`` there, a fallback any format it serves on this box:
    ``serve_formats[name]`` when the device narrows it (cpu-dev: MindSpore Lite only for a ``.ms``; it cannot
    read MindSpore 2.7's MindIR), else every format it reads. None fits: ``preferred``, whose load then names
    what is missing."""
    status = backend_status() if status is None else status
    narrowed = serve_formats or {}
    for name in [preferred] + list(fallbacks):
        if status.get(name) != "ok":
            logger.warning("backend %s unavailable: %s", name, status.get(name))
            continue
        wanted = {preferred_format} if name == preferred else set(narrowed.get(name, BACKENDS[name].formats))
        if served is not None and not wanted & set(served):
            logger.info("backend %s skipped: the bundle has no %s artifact for this box", name,
                        "/".join(sorted(wanted)))
            continue
        return name
    return preferred


def backend_for(device: Any, manifest: Optional[Any] = None) -> str:
    """:func:`pick_backend` for a device config and (when known) the manifest of the bundle it will serve."""
    served = None
    if manifest is not None:
        served = {a.format for a in manifest.artifacts if a.role == "serve" and a.target == device.target}
    return pick_backend(device.backend, device.fallback_backends, device.artifact_format, served,
                        serve_formats=device.serve_formats)


def backend_status() -> Dict[str, str]:
    """``{"mindspore": "ok", "acl": "module 'acl' not found (provided by ...)"}`` - imports no runtime."""
    status = {}
    for name, _ in _PLUGINS:
        status[name] = PLUGIN_ERRORS[name] if name in PLUGIN_ERRORS else BACKENDS[name].runtime_status()
    return status


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "BackendOptions",
    "BackendUnavailable",
    "TensorSpec",
    "artifact_format",
    "backend_for",
    "backend_status",
    "create_backend",
    "pick_backend",
]
