"""Ed25519 signatures over ``manifest.json`` (``manifest.sig``); ``cryptography`` is imported only when used."""

import os

from agent.bundle.manifest import MANIFEST, SIGNATURE, BundleError
from agent.config.schema import FieldError


def crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BundleError([FieldError("manifest.sig", "signature checks need the 'cryptography' package "
                                      "(pip install atlas-edge[edge])")]) from None
    return ed25519, serialization


def load_public_key(text: str) -> bytes:
    """A raw 32-byte Ed25519 public key from hex, or from a PEM file path."""
    if os.path.isfile(text):
        _ed, serialization = crypto()
        with open(text, "rb") as handle:
            key = serialization.load_pem_public_key(handle.read())
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes (got %d)" % len(raw))
    return raw


def verify_signature(root: str, public_key: bytes) -> bool:
    with open(os.path.join(root, MANIFEST), "rb") as handle:
        body = handle.read()
    with open(os.path.join(root, SIGNATURE), "rb") as handle:
        signature = handle.read()
    return signature_matches(body, signature, public_key)


def signature_matches(body: bytes, signature: bytes, public_key: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature of the manifest bytes ``body``."""
    ed25519, _ser = crypto()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, body)
    except InvalidSignature:
        return False
    return True


def sign_bundle(root: str, private_key_pem: bytes) -> str:
    """Write ``manifest.sig``; returns the public key as hex (what the box's config names)."""
    ed25519, serialization = crypto()
    key = serialization.load_pem_private_key(private_key_pem, password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError("the signing key must be Ed25519")
    with open(os.path.join(root, MANIFEST), "rb") as handle:
        signature = key.sign(handle.read())
    with open(os.path.join(root, SIGNATURE), "wb") as handle:
        handle.write(signature)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return public.hex()
