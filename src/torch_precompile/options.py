"""How ``precompile()`` builds an artifact: its keywords, checked once, as one value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch_precompile.errors import PrecompileError

BACKENDS = ("inductor", "eager")
TRACERS = ("make_fx", "dynamo")
WRAPPERS = ("auto", "cpp", "python")


def _grad_mode() -> bool:
    import torch

    return torch.is_grad_enabled()


@dataclass(frozen=True)
class BuildOptions:
    """How ``precompile()`` builds an artifact; the keywords of ``precompile()``, checked once
    when made (see ``Precompile`` for each one's meaning)."""

    backend: str = "inductor"
    tracer: str = "make_fx"
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    sign_key: bytes | None = None
    progress: Callable[[str], None] | None = None
    compile_on_one_rank: bool = False
    wrapper: str = "auto"
    require_all_guards: bool = False
    # The device a build without the weights (meta or fake tensors) is for; None otherwise.
    device: Any = None
    # Repeated blocks compiled once: None or True (found by structure), False, or classes.
    blocks: Any = None
    # Whether precompile() was called under grad mode: where it was not, results of an fn
    # without a backward carry no history, and no backward graph is built.
    grad_mode: bool = dataclasses.field(default_factory=lambda: _grad_mode())

    def __post_init__(self) -> None:
        if self.wrapper not in WRAPPERS:
            raise PrecompileError(f"wrapper must be one of {WRAPPERS}, got {self.wrapper!r}.")
        if self.wrapper == "cpp" and self.backend != "inductor":
            raise PrecompileError(
                f"wrapper={self.wrapper!r} chooses how the inductor backend calls its kernels; "
                f"backend={self.backend!r} has none. Leave wrapper out, or use "
                "backend='inductor'."
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.tracer not in TRACERS:
            raise ValueError(f"tracer must be one of {TRACERS}, got {self.tracer!r}.")
        if self.require_all_guards and self.tracer != "dynamo":
            raise PrecompileError(
                "require_all_guards=True asks about the guards of tracer='dynamo'; the make_fx "
                "tracer keeps none. Pass tracer='dynamo' too, or leave require_all_guards out."
            )
        if self.decompositions is not None and not isinstance(self.decompositions, Mapping):
            raise PrecompileError(
                "decompositions must be a mapping {OpOverload: function} or None, got "
                f"{type(self.decompositions).__name__}."
            )
