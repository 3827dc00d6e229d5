"""Build time: collect every C++ kernel Inductor built for a wrapper into the cache payload."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from torch_precompile import progress
from torch_precompile.artifact.kernel_payload import machine_fingerprint, write_payload
from torch_precompile.internals.inductor import (
    built_kernel_object,
    built_wrapper_object,
    cpp_kernel_calls,
    cpp_wrapper_build,
)
from torch_precompile.shipped.kernel_loader import kernel_key
from torch_precompile.spec import KernelObject


@dataclass(frozen=True)
class BuiltKernels:
    """The cache payload of a wrapper's kernels, and the digest of each object in it."""

    payload: bytes
    objects: tuple[KernelObject, ...]


def collect_built_kernels(wrapper_source: str) -> BuiltKernels:
    """Package the shared objects of every C++ kernel in ``wrapper_source``, and of the
    wrapper itself where it is Inductor's C++ wrapper."""
    built = [(built_kernel_object, call) for call in cpp_kernel_calls(wrapper_source)]
    wrapper = cpp_wrapper_build(wrapper_source)
    if wrapper is not None:
        built.append((built_wrapper_object, wrapper))
    kernels: dict[str, dict[str, Any]] = {}
    for done, (find_object, (argtypes, source, options)) in enumerate(built, 1):
        module, path = find_object(argtypes, source, options)
        progress.count("kernels built and packed", done, len(built))
        data = path.read_bytes()
        kernels[kernel_key(argtypes, source, options)] = {
            "module": module,
            "object": data,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    objects = tuple(KernelObject(key, entry["sha256"]) for key, entry in sorted(kernels.items()))
    return BuiltKernels(write_payload(machine_fingerprint(), kernels), objects)
