"""The cache: a versioned envelope that binds acceleration bytes to one ``python_code``.

It is ``torch.save`` of a plain dict, readable with ``weights_only=True``: the kernel payload
(``artifact``) and the compiled module (``compiled``, see ``bytecode``). Only a wrong pairing
is an error; anything else wrong with it just means running without acceleration.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.artifact import signature
from torch_precompile.errors import PrecompileError

FORMAT = "torch-precompile"
VERSION = 1
log = logging.getLogger("torch_precompile")


@functools.lru_cache(maxsize=2)
def code_hash(python_code: str) -> str:
    """sha256 of the source; remembered, since one load asks for it several times."""
    return hashlib.sha256(python_code.encode()).hexdigest()


@dataclass(frozen=True)
class CacheContents:
    """A readable envelope, not yet checked against any source."""

    backend: Any
    code_hash: Any
    acceleration: bytes | None
    compiled: Any  # the compiled-module entry, checked by bytecode.unseal

    def belongs_to(self, python_code: str) -> bool:
        return self.code_hash == code_hash(python_code)


def pack(backend: str, python_code: str, acceleration: bytes | None,
         compiled: dict[str, Any] | None = None) -> bytes:
    envelope = {
        "format": FORMAT,
        "version": VERSION,
        "backend": backend,
        "code_hash": code_hash(python_code),
        "artifact": acceleration,
    }
    if compiled is not None:
        envelope["compiled"] = compiled
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def unpack(cache: bytes | None, backend: str, python_code: str) -> bytes | None:
    """Return the acceleration bytes of ``cache``, or None when it cannot accelerate this code.

    Raises ``PrecompileError`` when ``cache`` belongs to another ``python_code``.
    """
    contents = read(cache)
    check_pairing(contents, backend, python_code)
    return None if contents is None else contents.acceleration


def read(cache: bytes | None) -> CacheContents | None:
    """The envelope in ``cache``, or None (with a warning) when there is no usable one."""
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
    artifact = envelope.get("artifact")
    return CacheContents(backend=envelope.get("backend"), code_hash=envelope.get("code_hash"),
                         acceleration=artifact if isinstance(artifact, bytes) else None,
                         compiled=envelope.get("compiled"))


def check_pairing(contents: CacheContents | None, backend: str, python_code: str) -> None:
    """Raise ``PrecompileError`` when a readable cache was made with another source."""
    if contents is None:
        return
    if contents.backend != backend:
        raise PrecompileError(
            f"the cache was made by backend {contents.backend!r} but python_code by "
            f"{backend!r}: they come from different precompile() calls. Pass the cache "
            "returned together with this python_code."
        )
    if not contents.belongs_to(python_code):
        raise PrecompileError(
            "the cache belongs to a different python_code (its code_hash does not match "
            "sha256(python_code)): they come from different precompile() calls. Pass the cache "
            "returned together with this python_code, or None to run without one."
        )
