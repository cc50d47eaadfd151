"""The model bundle, the contract between host and box (docs/bundle.md): the manifest's schema and task names
(``manifest``), hashing, verification and writing (``verify``), and Ed25519 signatures (``signing``).

Below ``pipeline`` and ``lifecycle`` (both read bundles) and the host packages: may import ``config``, ``_util``
and ``errors`` only.
"""
