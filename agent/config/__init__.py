"""Configuration as schemas: the schema engine, the daemon config and its overrides file, device configs and secret
references.

May import ``agent._util`` and ``agent.errors`` only; every other group imports from here.
"""
