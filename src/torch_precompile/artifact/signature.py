"""Optional signatures: an HMAC-SHA256 over ``python_code`` and the cache, kept in front of the
cache bytes, so a key holder can check a pair before anything is unpickled or executed.

A signed cache is ``MAGIC + hex digest + b"\\n" + envelope``; unsigned caches are the envelope
alone. A signature proves the pair was made by someone holding the key and not changed since;
it says nothing about whether that someone is trustworthy.
"""

from __future__ import annotations

import hashlib
import hmac

from torch_precompile.errors import PrecompileError

MAGIC = b"torch-precompile-signature-v1\n"
_DIGEST_LENGTH = 64  # hex characters of a SHA-256


def _digest(key: bytes, python_code: str, envelope: bytes) -> bytes:
    message = hashlib.sha256(python_code.encode()).digest() + hashlib.sha256(envelope).digest()
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode()


def sign(key: bytes, python_code: str, cache: bytes) -> bytes:
    """Return ``cache`` with a signature over it and ``python_code`` (replacing any earlier)."""
    _check_key(key, "sign_key")
    envelope = split(cache)[1]
    return MAGIC + _digest(key, python_code, envelope) + b"\n" + envelope


def split(cache: bytes) -> tuple[bytes | None, bytes]:
    """(signature or None, envelope bytes) of a cache."""
    if cache.startswith(MAGIC):
        rest = cache[len(MAGIC) :]
        signature, newline, envelope = (
            rest[:_DIGEST_LENGTH],
            rest[_DIGEST_LENGTH:][:1],
            rest[_DIGEST_LENGTH + 1 :],
        )
        if newline == b"\n":
            return signature, envelope
    return None, cache


def verify(key: bytes, python_code: str, cache: bytes | None) -> None:
    """Raise ``PrecompileError`` unless ``cache`` carries a valid signature for this pair."""
    _check_key(key, "verify_key")
    if cache is None:
        raise PrecompileError(
            "verify_key was given but there is no cache: the signature travels in the cache. "
            "Pass the signed cache saved with this python_code."
        )
    signature, envelope = split(bytes(cache))
    if signature is None:
        raise PrecompileError(
            "the artifact is not signed, and verify_key asks for a signed one; nothing was "
            "executed. Sign it with precompile(..., sign_key=...) or precompile.save(..., "
            "sign_key=...)."
        )
    if not hmac.compare_digest(signature, _digest(key, python_code, envelope)):
        raise PrecompileError(
            "the artifact's signature does not match: python_code or the cache was changed "
            "after signing, or it was signed with another key. Nothing was executed."
        )


def _check_key(key: object, name: str) -> None:
    if not isinstance(key, bytes | bytearray) or not key:
        raise PrecompileError(f"{name} must be non-empty bytes, got {type(key).__name__}.")
