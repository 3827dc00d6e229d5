"""The stand-in for Inductor's kernel builders (``AsyncCompile``, ``CppWrapperCodeCache``).

This module's source is copied into every inductor artifact, so it imports only the
standard library and never uses ``from __future__``. Kernels (and a C++ wrapper's shared
object) that ``load()`` found prebuilt in the cache arrive in the artifact's namespace as
``PRECOMPILED_KERNELS`` ({kernel key: callable}); any other kernel, and anything else the
wrapper asks of Inductor, goes to the real ``torch._inductor``, imported only then. A load
with every kernel prebuilt therefore never imports Inductor and never runs a compiler.

A kernel's source is written for one vector width (its loops step by that many lanes), so a
kernel built here is built for the width it was generated for, or refused where this CPU has
no such vector unit: built for another width, it would read and write past its buffers.

A load with ``require_prebuilt`` sets ``PRECOMPILED_KERNELS_ONLY`` in the same namespace; a
loader then refuses any build (``KernelBuildRefused``, which ``load`` raises as
``PrecompileError``) instead of running a compiler.
"""

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any


def kernel_key(argtypes: Any, source_code: str, options: Mapping[str, Any]) -> str:
    """The name a C++ kernel is filed under in the cache: a hash of how it is built."""
    text = json.dumps([list(argtypes), source_code, sorted(options.items())], default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class KernelBuildRefused(RuntimeError):
    """A kernel that this process would have to build cannot be built correctly here, or may
    not be built at all (``require_prebuilt``)."""


class KernelLoader:
    """Replaces ``AsyncCompile()``: hands out prebuilt kernels, builds the rest on demand.

    ``vector_bits`` is the vector width the kernels' source was generated for (0: scalar).
    ``resolve_now`` makes a kernel Inductor builds in the background ready before it is
    handed out: a graph defined inside a function (one variant of several) cannot have its
    names rebound by ``wait(globals())``. ``prebuilt_only`` refuses every build; None reads it
    from ``PRECOMPILED_KERNELS_ONLY`` in the namespace ``load`` filled.
    """

    def __init__(
        self,
        prebuilt: Mapping[str, Callable[..., Any]],
        vector_bits: int,
        resolve_now: bool = False,
        prebuilt_only: bool | None = None,
    ) -> None:
        self.prebuilt = prebuilt
        self.vector_bits = vector_bits
        self.resolve_now = resolve_now
        if prebuilt_only is None:
            # The line that makes the loader is part of the artifact's source, so the flag
            # comes the way the prebuilt kernels do: through the artifact's namespace.
            prebuilt_only = globals().get("PRECOMPILED_KERNELS_ONLY", False)
        self.prebuilt_only = bool(prebuilt_only)
        self.built_here: list[str] = []
        self._inductor: Any = None

    def cpp_pybinding(self, argtypes: list[str], source_code: str, **options: Any) -> Any:
        return self._prebuilt_or_built(
            kernel_key(argtypes, source_code, options),
            lambda: self._jit().cpp_pybinding(argtypes, source_code, **options),
            "C++ kernel",
        )

    def load_pybinding(self, argtypes: list[str], main_code: str, **options: Any) -> Any:
        """Replaces ``CppWrapperCodeCache.load_pybinding``: the C++ wrapper's entry point."""

        def build() -> Any:
            from torch._inductor.codecache import CppWrapperCodeCache

            return CppWrapperCodeCache.load_pybinding(
                argtypes=argtypes, main_code=main_code, **options
            )

        return self._prebuilt_or_built(
            kernel_key(argtypes, main_code, options), build, "C++ wrapper library"
        )

    def _prebuilt_or_built(self, key: str, build: Callable[[], Any], kind: str) -> Any:
        prebuilt = self.prebuilt.get(key)
        if prebuilt is not None:
            return prebuilt
        if self.prebuilt_only:
            raise KernelBuildRefused(
                f"require_prebuilt: this artifact's {kind} {key[:12]}… (kernel key {key}) is "
                f"not among the {len(self.prebuilt)} object(s) its cache provided, so it would "
                "be built here. Pass the cache precompile() made with this source, built on a "
                "machine like this one, or load without require_prebuilt (and without "
                "TORCH_PRECOMPILE_REQUIRE_PREBUILT=1) to let it build."
            )
        self.built_here.append(key)
        return self._build(build)

    def _build(self, build: Callable[[], Any]) -> Any:
        """Build for the width the source was generated for; refuse where this CPU has none."""
        from torch._inductor import config
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        with config.patch({"cpp.simdlen": self.vector_bits}):
            if pick_vec_isa().bit_width() != self.vector_bits:
                raise KernelBuildRefused(
                    f"these kernels were generated for {self.vector_bits}-bit vectors and this "
                    "CPU has no vector unit of that width, so they cannot be built here. Pass "
                    "the cache built with them on a machine like the one they were made on, "
                    "or precompile again on this machine."
                )
            built = build()
        return built.result() if self.resolve_now and hasattr(built, "result") else built

    def wait(self, scope: dict[str, Any]) -> None:
        if self._inductor is not None:
            self._inductor.wait(scope)

    def __getattr__(self, name: str) -> Any:
        # Triton and other kernel kinds are built (or fetched from their caches) by Inductor.
        if self.__dict__.get("prebuilt_only") and not name.startswith("__"):
            raise KernelBuildRefused(
                f"require_prebuilt: this artifact asks Inductor for {name!r} kernels, which no "
                "cache carries: they would be built (or read from Inductor's own cache) here. "
                "Load it without require_prebuilt (and without "
                "TORCH_PRECOMPILE_REQUIRE_PREBUILT=1)."
            )
        return getattr(self._jit(), name)

    def _jit(self) -> Any:
        if self._inductor is None:
            from torch._inductor.async_compile import AsyncCompile

            self._inductor = AsyncCompile()
        return self._inductor
