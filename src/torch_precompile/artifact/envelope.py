"""The cache: a versioned envelope that binds acceleration bytes to one ``python_code``.

It holds the kernel payload (``artifact``) and the compiled module (``compiled``, see
``bytecode``) for the source whose SHA-256 is ``code_hash``. Version 2 is a magic line, the
length of a JSON header, the header (every field, with the sizes of the two blobs) and the
blobs as raw bytes: reading it parses a few hundred bytes of JSON and slices, where version 1,
``torch.save`` of a plain dict (still read, with ``weights_only=True``), spent most of a load
unpickling megabytes of bytes. Only a wrong pairing is an error; anything else wrong with an
envelope just means running without acceleration.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
from dataclasses import dataclass
from typing import Any

from torch_precompile.artifact import signature
from torch_precompile.errors import PrecompileError

FORMAT = "torch-precompile"
VERSION = 2
READABLE_VERSIONS = (1, 2)
_MAGIC = b"torch-precompile cache, envelope version 2\n"
_LENGTH_BYTES = 8
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
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "backend": backend,
        "code_hash": code_hash(python_code),
        "artifact": None if acceleration is None else len(acceleration),
    }
    blobs = [acceleration or b""]
    if isinstance(compiled, dict) and isinstance(compiled.get("module"), bytes):
        header["compiled"] = {**compiled, "module": len(compiled["module"])}
        blobs.append(compiled["module"])
    elif compiled is not None:  # an entry load will not use, kept as it is
        header["compiled"] = compiled
    text = json.dumps(header).encode()
    return b"".join([_MAGIC, len(text).to_bytes(_LENGTH_BYTES, "little"), text, *blobs])


def decode(body: bytes) -> dict[str, Any]:
    """The envelope's fields as a plain dict (blobs as bytes), of either version; raises for
    bytes that are not an envelope."""
    if not body.startswith(_MAGIC):
        return _decode_version_1(body)
    start = len(_MAGIC) + _LENGTH_BYTES
    end = start + int.from_bytes(body[len(_MAGIC):start], "little")
    header = json.loads(body[start:end])
    if not isinstance(header, dict):
        raise ValueError("the envelope's header is not a JSON object")
    fields = dict(header)
    for name, place in (("artifact", fields), ("module", fields.get("compiled"))):
        if not isinstance(place, dict) or place.get(name) is None:
            continue
        size = place[name]
        if not isinstance(size, int) or size < 0 or end + size > len(body):
            raise ValueError(f"the envelope's {name} runs past its end")
        place[name] = body[end:end + size]
        end += size
    if end != len(body):
        raise ValueError("the envelope's blobs do not add up to its length")
    return fields


def _decode_version_1(body: bytes) -> dict[str, Any]:
    """A version-1 envelope: ``torch.save`` of the dict (imported only for one)."""
    import torch

    envelope = torch.load(io.BytesIO(body), weights_only=True)
    if not isinstance(envelope, dict):
        raise ValueError("not a torch-precompile envelope")
    return envelope


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
        envelope = decode(signature.split(bytes(cache))[1])
    except Exception as e:
        log.warning(
            "precompile cache unreadable (%s: %s); running from python_code alone, which "
            "builds its kernels on first use.", type(e).__name__, e
        )
        return None
    if envelope.get("format") != FORMAT:
        log.warning("precompile cache is not a torch-precompile envelope; running from "
                    "python_code alone.")
        return None
    if envelope.get("version") not in READABLE_VERSIONS:
        log.warning(
            "precompile cache has version %r, this torch-precompile reads %s; running from "
            "python_code alone.", envelope.get("version"),
            " and ".join(map(str, READABLE_VERSIONS))
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
