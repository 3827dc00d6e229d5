"""Stand-ins for the other ``torch._inductor`` names a Python wrapper imports.

Copied into an artifact whose section 2 is Inductor's Python wrapper (as ``kernel_loader``
is), so it imports only torch and the standard library. Each name resolves to the real one
the first time it is used, so a load that never uses it never imports Inductor.
"""

import importlib
from typing import Any, ClassVar

import torch


class LazyImport:
    """A module attribute that is imported the first time it is used."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        self._value: Any = None

    def resolve(self) -> Any:
        if self._value is None:
            self._value = getattr(importlib.import_module(self.module), self.name)
        return self._value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)


class ExternKernels:
    """Replaces ``select_algorithm.extern_kernels``: the common ones are plain torch functions."""

    _TORCH_FUNCTIONS: ClassVar[dict[str, str]] = {
        "mm": "mm",
        "addmm": "addmm",
        "bmm": "bmm",
        "baddbmm": "baddbmm",
        "convolution": "convolution",
        "mm_dtype": "mm",
        "bmm_dtype": "bmm",
        "_int_mm": "_int_mm",
    }

    def __getattr__(self, name: str) -> Any:
        if name in self._TORCH_FUNCTIONS:
            value = getattr(torch, self._TORCH_FUNCTIONS[name])
        else:
            importlib.import_module("torch._inductor.kernel")
            value = getattr(
                importlib.import_module("torch._inductor.select_algorithm").extern_kernels, name
            )
        setattr(self, name, value)
        return value
