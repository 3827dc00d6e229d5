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
HEADER_PROBE = 4096  # bytes that hold a signature and a header (a few hundred bytes) at once
_HEADER_LIMIT = 1 << 20  # a longer declared header means bytes that are not an envelope
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


def pack(
    backend: str,
    python_code: str,
    acceleration: bytes | None,
    compiled: dict[str, Any] | None = None,
) -> bytes:
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
    end = start + int.from_bytes(body[len(_MAGIC) : start], "little")
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
        place[name] = body[end : end + size]
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


def read(cache: bytes | None, problems: list[str] | None = None) -> CacheContents | None:
    """The envelope in ``cache``, or None when there is no usable one; why not is told to
    ``problems`` when given, else logged as a warning."""
    if cache is None:
        return None
    try:
        fields = decode(signature.split(bytes(cache))[1])
    except Exception as e:
        _unusable(
            f"precompile cache unreadable ({type(e).__name__}: {e}); running from "
            "python_code alone, which builds its kernels on first use.",
            problems,
        )
        return None
    why = _unreadable_version(fields)
    if why is not None:
        _unusable(why, problems)
        return None
    artifact = fields.get("artifact")
    return CacheContents(
        backend=fields.get("backend"),
        code_hash=fields.get("code_hash"),
        acceleration=artifact if isinstance(artifact, bytes) else None,
        compiled=fields.get("compiled"),
    )


def _unusable(why: str, problems: list[str] | None) -> None:
    if problems is None:
        log.warning("%s", why)
    else:
        problems.append(why)


def _unreadable_version(fields: dict[str, Any]) -> str | None:
    if fields.get("format") != FORMAT:
        return (
            "precompile cache is not a torch-precompile envelope; running from python_code alone."
        )
    if fields.get("version") not in READABLE_VERSIONS:
        return (
            f"precompile cache has version {fields.get('version')!r}, this "
            f"torch-precompile reads {' and '.join(map(str, READABLE_VERSIONS))}; running "
            "from python_code alone."
        )
    return None


def header_end(head: bytes) -> int | None:
    """How many leading bytes of a cache (its signature included) hold a version-2 envelope's
    header, read off its first ``HEADER_PROBE`` bytes; None when it starts no such envelope."""
    body = signature.split(head)[1]
    start = len(head) - len(body) + len(_MAGIC) + _LENGTH_BYTES
    if not body.startswith(_MAGIC) or len(head) < start:
        return None
    length = int.from_bytes(head[start - _LENGTH_BYTES : start], "little")
    return start + length if length <= _HEADER_LIMIT else None


def read_header(head: bytes) -> CacheContents | None:
    """The envelope a cache's first ``header_end(head)`` bytes (or more) hold, its blobs left
    unread (``acceleration`` and ``compiled`` None); None for a cache that is not a readable
    version-2 envelope. Quiet: it tells caches apart, it does not load one."""
    end = header_end(head)
    if end is None or end > len(head):
        return None
    start = len(head) - len(signature.split(head)[1]) + len(_MAGIC) + _LENGTH_BYTES
    try:
        fields = json.loads(head[start:end])
    except ValueError:
        return None
    if not isinstance(fields, dict) or _unreadable_version(fields) is not None:
        return None
    return CacheContents(
        backend=fields.get("backend"),
        code_hash=fields.get("code_hash"),
        acceleration=None,
        compiled=None,
    )


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
