"""Stage 4: ``load`` turns an artifact pair back into a callable, without re-tracing."""

from __future__ import annotations

import contextlib
import gc
import linecache
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from torch_precompile import prebuilt
from torch_precompile.artifact import bytecode, envelope, signature
from torch_precompile.errors import PrecompileError
from torch_precompile.internals import torch_build
from torch_precompile.spec import ArtifactSpec, compat, from_literal, parse_spec, shown_version

log = logging.getLogger("torch_precompile")
_announced: set[str] = set()  # code hashes of the sources load has said it executes
_announced_lock = threading.Lock()


class LoadedArtifact:
    """A loaded artifact: call it like the captured ``fn``, models included."""

    __slots__ = ("_forward", "backend", "spec")

    def __init__(self, forward: Callable[..., Any], spec: ArtifactSpec) -> None:
        self._forward = forward
        self.backend: str = spec.backend
        self.spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._forward(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ == "KernelBuildRefused":  # kernel_loader's, inside the artifact
                raise PrecompileError(str(e)) from e
            raise

    def __repr__(self) -> str:
        args = ", ".join(a.name for a in self.spec.args)
        return f"<precompiled {self.backend} artifact: forward({args})>"

    def _not_exportable(self, *_: Any, **__: Any) -> NoReturn:
        raise PrecompileError(
            "a loaded artifact cannot give back python_code or cache bytes: load() keeps only "
            "the running code. Keep the (python_code, cache) pair that precompile() returned "
            "and pass that on."
        )

    to_python_code = to_cache_bytes = _not_exportable
    python_code = cache = property(_not_exportable)

    def __reduce__(self) -> NoReturn:
        self._not_exportable()


def load(
    python_code: str,
    cache: bytes | None,
    verify_key: bytes | None = None,
    require_prebuilt: bool = False,
    *,
    cache_absence: str | None = None,
) -> LoadedArtifact:
    """Check the pair, make the cache's kernels available, execute ``python_code``.

    With ``require_prebuilt`` (or ``TORCH_PRECOMPILE_REQUIRE_PREBUILT=1``) a kernel the load
    or a call would build is a ``PrecompileError`` instead. ``cache_absence`` says why
    ``cache`` is None, for a pair read from files.
    """
    strict = prebuilt.required(require_prebuilt)
    with _collector_paused():
        return _load(python_code, cache, verify_key, strict, cache_absence)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """A load makes many objects and no cyclic garbage; next to a large model already in
    memory, each full collection it triggers walks that model (at 24 blocks, 3x the load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load(
    python_code: str,
    cache: bytes | None,
    verify_key: bytes | None,
    strict: bool,
    cache_absence: str | None,
) -> LoadedArtifact:
    if verify_key is not None:
        if not isinstance(python_code, str):
            raise PrecompileError("python_code must be a str.")
        signature.verify(verify_key, python_code, cache)
    # Under require_prebuilt why a cache is unusable may become the refusal: kept, not logged.
    problems: list[str] | None = [] if strict else None
    contents = envelope.read(cache, problems) if isinstance(python_code, str) else None
    compiled = (
        bytecode.unseal(python_code, contents.compiled)
        if contents is not None and contents.belongs_to(python_code)
        else None
    )
    spec = from_literal(compiled.spec_literal) if compiled is not None else parse_spec(python_code)
    check_torch_build(spec)
    envelope.check_pairing(contents, spec.backend, python_code)
    if problems is not None:
        prebuilt.refuse_builds(python_code, spec, cache, contents, cache_absence, problems)
        for why in problems:
            log.warning("%s", why)
    if cache is None and cache_absence is not None:
        log.warning("%s; running from the source alone.", cache_absence)
    _announce_execution(python_code)
    namespace: dict[str, Any] = {"__name__": "torch_precompile_artifact"}
    if contents is not None and contents.acceleration is not None and spec.backend == "inductor":
        from torch_precompile.artifact.kernel_payload import load_built_kernels

        pinned = compat.kernel_pins(spec)
        namespace["PRECOMPILED_KERNELS"] = load_built_kernels(contents.acceleration, pinned)
    if strict and spec.backend == "inductor":
        prebuilt.guard_namespace(python_code, namespace)
    width = _unrecorded_kernel_width(python_code, spec, contents, namespace)
    _execute(python_code, compiled, namespace, width)
    forward = namespace.get("forward")
    # forward is bound on the artifact's last lines (before schema 3, PLAN was): without it
    # the file was cut short.
    if not callable(forward) or (compat.ends_with_plan(spec) and namespace.get("PLAN") is None):
        raise PrecompileError(
            "python_code ran but did not reach its end (no forward bound to its spec): it is "
            "truncated or not an artifact."
        )
    # The driver raises the PrecompileError it finds in its globals at raise time; point it at
    # the package's class so callers can catch one type.
    namespace["PrecompileError"] = PrecompileError
    return LoadedArtifact(forward, spec)


def _announce_execution(python_code: str) -> None:
    """Say that load executes the source: once per source per process, since a server or a
    capture loads the same source many times. Unsaid while the logger would drop it."""
    if not log.isEnabledFor(logging.WARNING):
        return
    digest = envelope.code_hash(python_code)
    with _announced_lock:
        if digest in _announced:
            return
        _announced.add(digest)
    log.warning(
        "precompile.load is executing python_code (sha256 %s…): it is a program, so only load "
        "artifacts you made or trust. Said once per source per process; "
        "logging.getLogger('torch_precompile').setLevel(logging.ERROR) silences it.",
        digest[:12],
    )


# How an inductor artifact made before 0.8 creates its kernel loader: with no vector width.
_LOADER_WITHOUT_WIDTH = "KernelLoader(globals().get('PRECOMPILED_KERNELS', {}))"


def _unrecorded_kernel_width(
    python_code: str,
    spec: ArtifactSpec,
    contents: envelope.CacheContents | None,
    namespace: dict[str, Any],
) -> int | None:
    """The vector width to build an older artifact's missing kernels for (None: nothing to do).

    Its source does not say which width its kernels were generated for, and built for another
    one they read and write past their buffers. The width its cache's kernels were built for
    is theirs; with no cache to tell it, a build is refused.
    """
    if spec.backend != "inductor" or _LOADER_WITHOUT_WIDTH not in python_code:
        return None
    prebuilt = namespace.get("PRECOMPILED_KERNELS", {})
    if compat.names_kernels(spec) and all(k.key in prebuilt for k in spec.kernels):
        return None
    from torch_precompile.artifact.kernel_payload import built_vector_bits

    bits = built_vector_bits(contents.acceleration if contents is not None else None)
    if bits is None:
        raise PrecompileError(
            f"this artifact (schema {shown_version(spec.schema_version)}) needs kernels built "
            "from its source, and does not record the vector width that source was generated "
            "for; built for this CPU's width they could corrupt memory. Pass the cache "
            "precompile() returned with it, or precompile again with this version, which "
            "records the width."
        )
    return bits


def _execute(
    python_code: str,
    compiled: bytecode.CompiledModule | None,
    namespace: dict[str, Any],
    vector_bits: int | None = None,
) -> None:
    """Run the artifact's module: its code from the cache, else compiled from the source
    (with an older artifact's kernels built for ``vector_bits``, when given)."""
    filename = bytecode.filename(python_code)
    # Registered so that tracebacks through the artifact show its source lines.
    linecache.cache[filename] = (len(python_code), None, python_code.splitlines(True), filename)
    try:
        code = compiled.code if compiled is not None else compile(python_code, filename, "exec")
        if vector_bits is None:
            exec(code, namespace)
        else:
            from torch_precompile.internals.vector_units import kernels_built_for

            with kernels_built_for(vector_bits):
                exec(code, namespace)
    except PrecompileError:
        raise
    except Exception as e:
        if type(e).__name__ == "KernelBuildRefused":  # kernel_loader's, inside the artifact
            raise PrecompileError(str(e)) from e
        raise PrecompileError(
            f"executing python_code failed ({type(e).__name__}: {e}); it is damaged, or needs "
            "what this process lacks (with no usable cache, a C++ compiler to build kernels)."
        ) from e


def check_torch_build(spec: ArtifactSpec) -> None:
    """An artifact runs under the torch build it was made with, and no other."""
    here = torch_build()
    if spec.torch != here:
        raise PrecompileError(
            f"this artifact was built with torch {spec.torch.version} (git {spec.torch.git}); "
            f"this process runs torch {here.version} (git {here.git}). Its compiled graph and "
            "driver are tied to the build that made them: precompile fn again under this torch."
        )
