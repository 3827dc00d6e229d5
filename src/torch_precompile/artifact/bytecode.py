"""The artifact compiled once, at build time: its module code and its spec, in the cache.

Compiling a large source and parsing its spec are most of a load. ``seal`` compiles the
rendered source, keeps the code object and the spec literal (``marshal``), and appends one
comment line, the seal, naming a digest over the source above it and that blob. A comment
changes no line and no code, so the blob is exactly what compiling the sealed source gives.
``unseal`` hands the blob back only when the seal names it together with the very source it
ends, and this interpreter wrote it: the source vouches for it, as it does for each kernel
object. Anything else means compiling the source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import marshal
import re
from dataclasses import dataclass
from types import CodeType
from typing import Any

from torch_precompile.errors import PrecompileError
from torch_precompile.spec import spec_literal

log = logging.getLogger("torch_precompile")
MAGIC = importlib.util.MAGIC_NUMBER.hex()
_SEAL = re.compile(
    r"\n# The cache holds this file compiled by CPython \(magic ([0-9a-f]+)\); load\(\) runs that "
    r"copy\n# only if this seal matches it and the lines above:\n# sha256 ([0-9a-f]{64})\.\n\Z"
)
_SEAL_CHARS = 400  # the seal is the file's last lines: search only the file's end


@dataclass(frozen=True)
class CompiledModule:
    """The sealed source's module code and its spec literal, ready to run."""

    code: CodeType
    spec_literal: dict[str, Any]


def seal(python_code: str) -> tuple[str, dict[str, Any]]:
    """The source with its seal line, and the cache entry holding its compiled form."""
    code = compile(python_code, filename(python_code), "exec")
    blob = marshal.dumps((code, spec_literal(python_code)))
    sealed = (
        f"{python_code}\n# The cache holds this file compiled by CPython (magic {MAGIC}); "
        "load() runs that copy\n# only if this seal matches it and the lines above:\n"
        f"# sha256 {_digest(python_code, blob)}.\n"
    )
    return sealed, {"magic": MAGIC, "sha256": hashlib.sha256(blob).hexdigest(), "module": blob}


def _seal(python_code: str) -> re.Match[str] | None:
    return _SEAL.search(python_code, max(0, len(python_code) - _SEAL_CHARS))


def _digest(source: str, blob: bytes) -> str:
    """What a seal names: the source it ends and the compiled module, together."""
    return hashlib.sha256(hashlib.sha256(source.encode()).digest() + blob).hexdigest()


def body(python_code: str) -> str:
    """The source without its seal line: what was compiled."""
    match = _seal(python_code)
    return python_code if match is None else python_code[: match.start()]


def is_sealed(python_code: str) -> bool:
    return _seal(python_code) is not None


def filename(python_code: str) -> str:
    """The name tracebacks show for the artifact's lines (seal line or not, the same)."""
    digest = hashlib.sha256(body(python_code).encode()).hexdigest()
    return f"<precompiled artifact {digest[:12]}>"


def unseal(python_code: str, entry: Any) -> CompiledModule | None:
    """The compiled module the source's seal names, or None when the source must be compiled.

    Raises ``PrecompileError`` for an intact entry that the seal does not name: the cache was
    altered, or belongs to another build of this source.
    """
    match = _seal(python_code)
    if match is None or not isinstance(entry, dict) or entry.get("magic") != MAGIC:
        return None  # an unsealed source, an older cache, or another interpreter's bytecode
    blob = entry.get("module")
    if not isinstance(blob, bytes):
        log.warning("precompile cache: its compiled module is malformed; compiling the source.")
        return None
    if match.group(1) != MAGIC or _digest(python_code[: match.start()], blob) != match.group(2):
        if hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
            log.warning(
                "precompile cache: its compiled module is damaged (it does not match "
                "its checksum); compiling the source."
            )
            return None
        raise PrecompileError(
            "the cache holds a compiled module that the seal on python_code's last line does "
            "not name for this source. The source was edited, or the cache altered or made "
            "for another build of it: pass the pair precompile() returned, or None as the "
            "cache to compile the source."
        )
    code, literal = marshal.loads(blob)
    return CompiledModule(code=code, spec_literal=literal)
