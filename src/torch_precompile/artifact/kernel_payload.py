"""The cache's acceleration bytes for the inductor backend, as ``load`` reads them.

The payload holds each built C++ kernel's shared object under its ``kernel_key`` and a
fingerprint of what the objects were built for (``lower.kernels`` collects them at build
time). At load time matching objects are loaded straight into the process as extension
modules -- no compiler, no Inductor import -- and handed to the artifact.

Its layout is plain, so that reading it costs nothing next to mapping the objects: a magic
line, the length of a JSON header, the header (the fingerprint; each kernel's module name,
digest and size), then the objects back to back in the header's order. Payloads of version 1
(``torch.save`` of the same table) are still read.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import enable_prebuilt_kernel_imports, torch_build

log = logging.getLogger("torch_precompile")
PAYLOAD_VERSION = 2
_MAGIC = b"torch-precompile kernel payload 2\n"
_LENGTH_BYTES = 8
_open_objects: list[int] = []
_loaded_kinds: dict[str, str] = {}  # what loaded_objects() reports


@cache
def machine_fingerprint() -> dict[str, Any]:
    """What a built kernel object depends on: torch build, Python, CPU architecture and ISA."""
    return {
        "torch": torch_build().version,
        "torch_git": torch_build().git,
        "python": list(sys.version_info[:2]),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": sorted(_cpu_flags()),
    }


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def fingerprint_mismatch(built_for: dict[str, Any]) -> str | None:
    """Why objects built for ``built_for`` cannot run here, or None when they can."""
    here = machine_fingerprint()
    for field in ("torch", "torch_git", "python", "machine"):
        if built_for.get(field) != here[field]:
            return f"{field} is {here[field]!r} here, {built_for.get(field)!r} at build"
    missing = set(built_for.get("cpu_flags", [])) - set(here["cpu_flags"])
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing)[:8])}"
    return None


@dataclass(frozen=True)
class PayloadExamination:
    """What a load does with a kernel payload, decided before any object is mapped."""

    entries: dict[str, dict[str, Any]]  # every well-formed entry, by kernel key
    mapped: dict[str, dict[str, Any]]  # the entries a load here maps into the process
    skipped: dict[str, str]  # kernel key -> why a load skips its object
    missing: list[str]  # keys the source names that the payload lacks
    mismatch: str | None  # why its objects cannot run here (None: built for this machine)
    refusal: str | None  # the error a load raises for an object the source does not name
    unreadable: str | None  # why the payload could not be read (None: it was)


def examine_payload(acceleration: bytes, pinned: Mapping[str, str] | None) -> PayloadExamination:
    """Judge each object of the payload as ``load_built_kernels`` does, mapping none."""
    try:
        payload = read_payload(acceleration)
        kernels = payload["kernels"]
        built_for = payload["fingerprint"]
        if not isinstance(kernels, dict):
            raise ValueError("its kernel table is not a mapping")
    except Exception as e:
        return PayloadExamination({}, {}, {}, [], None, None, str(e))
    entries, usable, skipped, refusal = {}, {}, {}, None
    for key, entry in kernels.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("object"), bytes)):
            skipped[str(key)] = "a malformed entry"
            continue
        entries[key] = entry
        verdict = _object_verdict(key, entry, pinned)
        if verdict is None:
            usable[key] = entry
        elif verdict[0]:
            refusal = refusal or verdict[1]
        else:
            skipped[key] = verdict[1]
    mismatch = fingerprint_mismatch(built_for)
    return PayloadExamination(
        entries,
        {} if mismatch else usable,
        skipped,
        sorted(set(pinned or ()) - set(kernels)),
        mismatch,
        refusal,
        None,
    )


def load_built_kernels(
    acceleration: bytes, pinned: Mapping[str, str] | None
) -> dict[str, Callable[..., Any]]:
    """Load the cache's kernel objects into this process; skip (with a warning) what cannot be.

    ``pinned`` maps each kernel key to the digest python_code names for its object (None for
    an artifact that names none). Every object is checked against it before any is mapped: an
    object the source does not name is refused.
    """
    found = examine_payload(acceleration, pinned)
    if found.unreadable is not None:
        log.warning(
            "precompile cache: kernel payload unreadable (%s); kernels will be built "
            "from python_code on first use.",
            found.unreadable,
        )
        return {}
    for key, why in found.skipped.items():
        log.warning(
            "precompile cache: kernel %s… is unusable (%s); it will be built from "
            "python_code on first use.",
            key[:12],
            why,
        )
    if found.refusal is not None:
        raise PrecompileError(found.refusal)
    if found.missing:
        log.warning(
            "precompile cache: it lacks %d kernel object(s) python_code names (%s); "
            "they will be built from python_code on first use.",
            len(found.missing),
            ", ".join(f"{key[:12]}…" for key in found.missing[:4]),
        )
    if found.mismatch is not None:
        log.warning(
            "precompile cache: its kernels were built for another machine or torch "
            "(%s); they will be built from python_code on first use.",
            found.mismatch,
        )
        return {}
    enable_prebuilt_kernel_imports()
    loaded: dict[str, Callable[..., Any]] = {}
    for key, entry in found.mapped.items():
        try:
            loaded[key] = _load_object(key, entry)
        except Exception as e:
            log.warning(
                "precompile cache: kernel %s… is unusable (%s); it will be built from "
                "python_code on first use.",
                key[:12],
                e,
            )
    return loaded


# The vector width Inductor picks for each ATen CPU capability (x86: the only ones it can
# name from a fingerprint alone).
_CAPABILITY_BITS = {"AVX512": 512, "AVX2": 256}


def built_vector_bits(acceleration: bytes | None) -> int | None:
    """The vector width the payload's kernels were built for, where its fingerprint says."""
    try:
        fingerprint = read_payload(acceleration or b"")["fingerprint"]
    except Exception:
        return None
    return _CAPABILITY_BITS.get(fingerprint.get("cpu_capability"))


def write_payload(fingerprint: dict[str, Any], kernels: Mapping[str, dict[str, Any]]) -> bytes:
    """The payload of ``kernels`` ({key: {"module", "object", "sha256"}})."""
    header = {
        "fingerprint": fingerprint,
        "kernels": {
            key: {
                "module": entry["module"],
                "sha256": entry["sha256"],
                "size": len(entry["object"]),
            }
            for key, entry in kernels.items()
        },
    }
    text = json.dumps(header).encode()
    return b"".join(
        [
            _MAGIC,
            len(text).to_bytes(_LENGTH_BYTES, "little"),
            text,
            *(entry["object"] for entry in kernels.values()),
        ]
    )


def merged_payloads(payloads: Sequence[bytes]) -> bytes:
    """One payload holding every kernel of ``payloads`` (all built here, at one build), each
    object once."""
    read = [read_payload(data) for data in payloads]
    kernels = {key: entry for payload in read for key, entry in payload["kernels"].items()}
    return write_payload(read[0]["fingerprint"], kernels)


def read_payload(data: bytes) -> dict[str, Any]:
    """``{"version", "fingerprint", "kernels": {key: {"module", "object", "sha256"}}}``;
    raises for anything that is not a payload of a version this package reads."""
    if not data.startswith(_MAGIC):
        payload = torch.load(io.BytesIO(data), weights_only=True)
        version = payload.get("version") if isinstance(payload, dict) else None
        if version != 1:
            raise ValueError(f"kernel payload version {version!r}")
        return payload
    start = len(_MAGIC) + _LENGTH_BYTES
    end = start + int.from_bytes(data[len(_MAGIC) : start], "little")
    header = json.loads(data[start:end])
    kernels = {}
    for key, entry in header["kernels"].items():
        kernels[key] = {
            "module": entry["module"],
            "sha256": entry["sha256"],
            "object": data[end : end + entry["size"]],
        }
        end += entry["size"]
    if end != len(data):
        raise ValueError("the kernel payload's objects do not add up to its length")
    return {"version": PAYLOAD_VERSION, "fingerprint": header["fingerprint"], "kernels": kernels}


def _object_verdict(
    key: str, entry: Mapping[str, Any], pinned: Mapping[str, str] | None
) -> tuple[bool, str] | None:
    """None for an object a load may map; else (refused, why): skipped for damaged bytes, or
    refused, with the error a load raises, for an intact object the source does not name."""
    digest = hashlib.sha256(entry["object"]).hexdigest()
    intact = digest == entry.get("sha256")
    if (pinned is None and intact) or (pinned is not None and pinned.get(key) == digest):
        return None
    if pinned is None or (key in pinned and not intact):
        return False, "its bytes are damaged: they do not match their checksum"
    named = (
        f"python_code names sha256 {pinned[key][:16]}…"
        if key in pinned
        else "python_code names no such kernel"
    )
    return True, (
        f"the cache holds a kernel object that is not one python_code was built with "
        f"(kernel {key[:12]}…: sha256 {digest[:16]}…, {named}). The cache was altered or "
        "belongs to another build of this source: pass the cache precompile() returned "
        "with it, or None to build the kernels from python_code."
    )


# The entry point Inductor's C++ wrapper names its shared object after (its
# ``CppWrapperCodeCache.entry_function``); each kernel's is ``kernel``.
WRAPPER_ENTRY = "inductor_entry_cpp"
WRAPPER_LIBRARY = "C++ wrapper library"
KERNEL = "C++ kernel"


def object_kind(entry: Mapping[str, Any]) -> str:
    """What a payload entry holds: a C++ wrapper's compiled library or one C++ kernel."""
    return WRAPPER_LIBRARY if entry.get("module") == WRAPPER_ENTRY else KERNEL


def count_objects(kinds: Iterable[str]) -> str:
    """``["C++ kernel", "C++ kernel"]`` as "2 C++ kernels": how reports count objects."""
    counts = Counter(kinds)
    plurals = {KERNEL: "C++ kernels", WRAPPER_LIBRARY: "C++ wrapper libraries"}
    shown = [
        f"{n} {kind if n == 1 else plurals.get(kind, kind)}"
        for kind, n in sorted(counts.items(), key=lambda item: item[0] != KERNEL)
    ]
    return " and ".join(shown) or "no prebuilt object"


def loaded_objects() -> dict[str, str]:
    """Each object this process mapped from a cache: kernel key -> ``object_kind``."""
    return dict(_loaded_kinds)


def _load_object(key: str, entry: dict[str, Any]) -> Callable[..., Any]:
    data = entry["object"]
    # The entry point is PyInit_<last component>, so the name must end with the built one.
    name = f"torch_precompile_kernel_{key[:24]}.{entry['module']}"
    module = sys.modules.get(name)
    if module is None:
        module = sys.modules[name] = _import_extension(name, data)
    _loaded_kinds[key] = object_kind(entry)
    return getattr(module, entry["module"])  # the entry point is named like the module


def _import_extension(name: str, data: bytes) -> ModuleType:
    import importlib.machinery
    import importlib.util

    in_memory = hasattr(os, "memfd_create")
    if in_memory:
        # An anonymous in-memory file: nothing touches the disk (or a noexec temp dir). It stays
        # open for the life of the process, because the dynamic loader recognizes objects by
        # path and a reused descriptor number would hand back an earlier kernel.
        fd = os.memfd_create("torch-precompile-kernel")
        _open_objects.append(fd)
        path = f"/proc/self/fd/{fd}"
    else:
        fd, path = tempfile.mkstemp(suffix=".so")
    try:
        os.write(fd, data)
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    finally:
        if not in_memory:
            os.close(fd)
            os.unlink(path)
