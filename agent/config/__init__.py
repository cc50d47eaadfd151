"""Configuration as schemas: the schema engine, the daemon config and its overrides file, device configs and secret
references.

May import ``_util`` and ``errors`` only; the layers are in docs/architecture.md (checked by lint-imports).
"""
