"""Which vector units this CPU has, as Inductor's C++ kernels see them: the width kernels are
generated for here, Inductor's probes of the units, and builds for a given width."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch_precompile.errors import PrecompileError


def vector_bits() -> int:
    """The vector width, in bits, Inductor generates C++ kernels for here (0: scalar)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    probe_vector_units()
    return int(pick_vec_isa().bit_width())


@functools.cache
def probe_vector_units() -> None:
    """Run Inductor's probes of this CPU's vector units side by side, once per process.

    The first lowering in a process asks which vector units build and load here: one compiler
    run and one new process per unit the CPU names, one unit after another (7.7 s for three
    units on a cold Inductor cache, on two cores). The probes are independent, so here each
    runs in a thread of its own (3.8 s); Inductor then finds every answer cached. A probe
    that fails here is only asked again, the same way, where Inductor needs it.
    """
    import platform
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64") or inductor_config.cpp.vec_isa_ok is not None:
        return  # one unit at most to probe, or none probed at all
    with contextlib.suppress(Exception):
        named = cpu_vec_isa.x86_isa_checker()
        units = [
            unit
            for unit in cpu_vec_isa.supported_vec_isa_list
            if all(flag in named for flag in str(unit).split())
        ]
        with ThreadPoolExecutor(max_workers=max(len(units), 1)) as pool:
            list(pool.map(bool, units))  # a unit's truth value is its (cached) probe


@contextlib.contextmanager
def kernels_built_for(bits: int) -> Iterator[None]:
    """Inductor's kernel builds, while inside, for ``bits``-bit vectors (refused where this
    CPU has none of that width)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.simdlen": bits}):
        if vector_bits() != bits:
            raise PrecompileError(
                f"this artifact's kernels were generated for {bits}-bit vectors and this CPU "
                "has no vector unit of that width, so they cannot be built here. Precompile "
                "again on this machine."
            )
        yield
