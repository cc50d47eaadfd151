"""Inference backends, found rather than hard-wired: a registry from name to backend class.

Like Frigate's detector registry, every plugin module is imported here and an ImportError in one is logged
and recorded instead of breaking the others. Our plugin modules import only numpy at module level (each
imports its runtime inside ``load()``), so this package imports on any box; what a box lacks is reported by
:func:`backend_status` without importing anything heavy, and by :class:`BackendUnavailable` at load.

Names match ``agent.config.device_config.BACKEND_FORMATS`` (mindspore, opencv, mslite, acl).
"""

import importlib
import logging
from typing import Dict, Optional, Tuple

from agent.pipeline.backends.base import (
    Backend,
    BackendError,
    BackendOptions,
    BackendUnavailable,
    TensorSpec,
    artifact_format,
)

logger = logging.getLogger(__name__)

# name -> (module, class); the order is the order status is reported in
_PLUGINS: Tuple[Tuple[str, str, str], ...] = (
    ("mindspore", "agent.pipeline.backends.mindspore_backend", "MindSporeBackend"),
    ("opencv", "agent.pipeline.backends.opencv_backend", "OpenCvBackend"),
    ("mslite", "agent.pipeline.backends.mslite_backend", "MindSporeLiteBackend"),
    ("acl", "agent.pipeline.backends.acl_backend", "AclBackend"),
)


def _discover() -> Tuple[Dict[str, type], Dict[str, str]]:
    found: Dict[str, type] = {}
    errors: Dict[str, str] = {}
    for name, module, class_name in _PLUGINS:
        try:
            found[name] = getattr(importlib.import_module(module), class_name)
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


def backend_status() -> Dict[str, str]:
    """``{"mindspore": "ok", "acl": "module 'acl' not found (provided by ...)"}`` - imports no runtime."""
    status = {}
    for name, _, _ in _PLUGINS:
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
    "backend_status",
    "create_backend",
]
