"""``require_prebuilt``: a load that would build a compiled object here is refused instead.

What the spec and the cache tell is checked before the source runs: an inductor artifact of
schema 3 or later names every object it needs (its C++ kernels, its C++ wrapper's library), so
a missing cache, an unusable one or a missing object is refused early. What shows only while
the source runs (an artifact older than schema 3, a kernel kind no cache carries) is refused by
the artifact's kernel loader, told by ``PRECOMPILED_KERNELS_ONLY`` in its namespace.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch_precompile.artifact import envelope
from torch_precompile.errors import PrecompileError
from torch_precompile.spec import ArtifactSpec, compat

if TYPE_CHECKING:  # the payload module imports torch: load imports it only for inductor
    from torch_precompile.artifact.kernel_payload import PayloadExamination

VARIABLE = "TORCH_PRECOMPILE_REQUIRE_PREBUILT"
NAMESPACE_FLAG = "PRECOMPILED_KERNELS_ONLY"  # what kernel_loader reads
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_SHOWN = 4  # missing objects a message names before "and N more"
_FIX = (
    "Pass the cache precompile() made with this source, built on a machine like this one "
    "(precompile.save writes it beside the source), or load without require_prebuilt "
    f"(and without {VARIABLE}=1) to let it build."
)


def required(require_prebuilt: bool) -> bool:
    """Whether a load refuses builds: asked by its keyword, or by the environment variable
    for every load in the process."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value not in _ON + _OFF:
        raise PrecompileError(
            f"{VARIABLE}={os.environ[VARIABLE]!r} is not understood: set it to 1 to refuse "
            "kernel builds at every load, or to 0 (or unset it) to allow them."
        )
    return bool(require_prebuilt) or value in _ON


def refuse_builds(
    python_code: str,
    spec: ArtifactSpec,
    cache: bytes | None,
    contents: envelope.CacheContents | None,
    absence: str | None,
    problems: list[str],
) -> None:
    """Raise ``PrecompileError`` when loading would build a compiled object here, as far as
    the spec and the cache tell before anything runs. ``absence`` says why ``cache`` is None
    (a pair read from files); ``problems`` why the envelope is unusable."""
    if spec.backend != "inductor":
        return  # the eager graph builds nothing
    named = [k.key for k in spec.kernels] if compat.names_kernels(spec) else None
    if named == []:
        return  # no C++ object to build; another kernel kind is the loader's to refuse
    acceleration = contents.acceleration if contents is not None else None
    if acceleration is None:
        raise PrecompileError(
            f"require_prebuilt: {_why_no_kernels(cache, contents, absence, problems)}, so this "
            f"inductor artifact would build {_count(named)} from its source here. {_FIX}"
        )
    from torch_precompile.artifact.kernel_payload import examine_payload

    pins = {k.key: k.sha256 for k in spec.kernels} if named is not None else None
    found = examine_payload(acceleration, pins)
    if found.refusal is not None:
        return  # load refuses such a cache anyway, with its own error
    whole = found.unreadable or found.mismatch
    if named is None:  # schema < 3 names nothing: the loader refuses what it misses
        if whole or not found.mapped:
            raise PrecompileError(
                f"require_prebuilt: {_whole_payload(found)}, so this "
                f"inductor artifact would build its kernels here. {_FIX}"
            )
        return
    missing = [key for key in named if key not in found.mapped]
    if missing:
        raise PrecompileError(_missing(python_code, named, missing, found))


def _why_no_kernels(
    cache: bytes | None,
    contents: envelope.CacheContents | None,
    absence: str | None,
    problems: list[str],
) -> str:
    if cache is None:
        return absence or "no cache was given"
    if contents is None:
        why = problems[0] if problems else "it is not a torch-precompile cache"
        return f"the cache is unusable ({why.partition('; running from')[0]})"
    return "the cache holds no kernel objects"


def _count(named: list[str] | None) -> str:
    if named is None:
        return "its kernels"
    return f"its {len(named)} compiled object{'s' if len(named) != 1 else ''}"


def _whole_payload(found: PayloadExamination) -> str:
    if found.unreadable is not None:
        return f"the cache's kernel payload is unreadable ({found.unreadable})"
    if found.mismatch is not None:
        return f"the cache's objects were built for another machine or torch ({found.mismatch})"
    return "the cache holds no usable kernel object"


def _missing(
    python_code: str, named: list[str], missing: list[str], found: PayloadExamination
) -> str:
    """The refusal for objects the artifact names that a load here could not map."""
    from torch_precompile.artifact.kernel_payload import object_kind

    absent_kind = _kind_in_source(python_code)

    def one(key: str) -> str:
        entry = found.entries.get(key)
        kind = object_kind(entry) if entry is not None else absent_kind
        why = found.skipped.get(key) or ("not in the cache" if key in found.missing else "")
        return f"{kind} {key[:12]}…" + (f" ({why})" if why else "")

    listed = ", ".join(one(key) for key in missing[:_SHOWN])
    if len(missing) > _SHOWN:
        listed += f" and {len(missing) - _SHOWN} more"
    whole = found.unreadable or found.mismatch
    because = f"; {_whole_payload(found)}" if whole else ""
    return (
        f"require_prebuilt: the cache lacks {len(missing)} of the {len(named)} compiled "
        f"objects this artifact names: {listed}{because}. Loading it would build them here. "
        f"{_FIX}"
    )


def _kind_in_source(python_code: str) -> str:
    """What an object the cache lacks is, as far as the source's calls tell (the wrapper's
    library and the kernels are named by keys alone)."""
    from torch_precompile.artifact.kernel_payload import KERNEL, WRAPPER_LIBRARY

    wrapper = "= CppWrapperCodeCache.load_pybinding(" in python_code
    kernels = "= async_compile.cpp_pybinding(" in python_code
    if wrapper != kernels:
        return WRAPPER_LIBRARY if wrapper else KERNEL
    return "compiled object"


def guard_namespace(python_code: str, namespace: dict[str, Any]) -> None:
    """Tell the artifact's kernel loader to refuse builds. A loader older than the flag
    ignores it; every loader looks a kernel up with ``.get`` before building it, so for
    those the table itself refuses a miss."""
    namespace[NAMESPACE_FLAG] = True
    if NAMESPACE_FLAG not in python_code:
        namespace["PRECOMPILED_KERNELS"] = _PrebuiltOnly(namespace.get("PRECOMPILED_KERNELS", {}))


class _PrebuiltOnly(dict[str, Callable[..., Any]]):
    """A prebuilt kernel table whose ``get`` refuses a kernel it lacks."""

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            return self[key]
        raise PrecompileError(
            f"require_prebuilt: this artifact asks for kernel {str(key)[:12]}… (kernel key "
            f"{key}), which its cache did not provide ({len(self)} object(s) did), so it "
            f"would build it here. {_FIX}"
        )
