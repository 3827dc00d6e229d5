"""The cache: a versioned envelope that binds acceleration bytes to one ``python_code``.

It is ``torch.save`` of a plain dict, readable with ``weights_only=True``. Only a wrong pairing
is an error; anything else wrong with it just means running without acceleration.
"""

from __future__ import annotations

import hashlib
import io
import logging

import torch

from torch_precompile.artifact import signature
from torch_precompile.errors import PrecompileError

FORMAT = "torch-precompile"
VERSION = 1
log = logging.getLogger("torch_precompile")


def code_hash(python_code: str) -> str:
    return hashlib.sha256(python_code.encode()).hexdigest()


def pack(backend: str, python_code: str, acceleration: bytes | None) -> bytes:
    envelope = {
        "format": FORMAT,
        "version": VERSION,
        "backend": backend,
        "code_hash": code_hash(python_code),
        "artifact": acceleration,
    }
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def unpack(cache: bytes | None, backend: str, python_code: str) -> bytes | None:
    """Return the acceleration bytes of ``cache``, or None when it cannot accelerate this code.

    Raises ``PrecompileError`` when ``cache`` belongs to another ``python_code``.
    """
    if cache is None:
        return None
    try:
        envelope = torch.load(io.BytesIO(signature.split(bytes(cache))[1]), weights_only=True)
    except Exception as e:
        log.warning(
            "precompile cache unreadable (%s: %s); running from python_code alone, which "
            "builds its kernels on first use.", type(e).__name__, e
        )
        return None
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        log.warning("precompile cache is not a torch-precompile envelope; running from "
                    "python_code alone.")
        return None
    if envelope.get("version") != VERSION:
        log.warning(
            "precompile cache has version %r, this torch-precompile reads %r; running from "
            "python_code alone.", envelope.get("version"), VERSION
        )
        return None
    if envelope.get("backend") != backend:
        raise PrecompileError(
            f"the cache was made by backend {envelope.get('backend')!r} but python_code by "
            f"{backend!r}: they come from different precompile() calls. Pass the cache "
            "returned together with this python_code."
        )
    if envelope.get("code_hash") != code_hash(python_code):
        raise PrecompileError(
            "the cache belongs to a different python_code (its code_hash does not match "
            "sha256(python_code)): they come from different precompile() calls. Pass the cache "
            "returned together with this python_code, or None to run without one."
        )
    artifact = envelope.get("artifact")
    return artifact if isinstance(artifact, bytes) else None
