"""The module form: a model whose ``forward`` runs its precompiled artifact.

Training code written for ``nn.Module`` (a plain loop, a Trainer, a pipeline stage) takes it
in place of the model: it holds the model, so ``parameters()``, ``state_dict()``, ``train()``,
``eval()`` and ``to()`` act on the model itself, and its results carry autograd history (see
``driver/autograd.py``), so the caller's own ``backward()`` and optimizer work unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from torch_precompile.errors import PrecompileError

MODES = ("train", "eval")


def call_module(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The computation the module form captures: one call of the model."""
    return model(*args, **kwargs)


class PrecompiledModule(torch.nn.Module):
    """``model``, with ``forward`` running a precompiled artifact of ``model(*args, **kwargs)``.

    Attributes the wrapper lacks are read from the model (``config``, say). ``state_dict()``
    and ``load_state_dict()`` are the model's own (no prefix). ``pair`` is the artifact pair
    (None when made from a loaded artifact); ``save(path)`` writes it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        artifact: Callable[..., Any],
        pair: tuple[str, bytes | None] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.__dict__["artifact"] = artifact  # a plain attribute, not a submodule
        self.__dict__["pair"] = pair

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.artifact(self.model, args, kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    def save(self, path: str | os.PathLike[str], *, sign_key: bytes | None = None) -> Path:
        """Write the artifact pair to ``path`` and its cache beside it (as ``precompile.save``);
        load it back with ``precompile.module(model, artifact=precompile.load(path))``."""
        if self.pair is None:
            raise PrecompileError(
                "this module was made from a loaded artifact, which keeps no pair to save; "
                "save the files it was loaded from instead."
            )
        from torch_precompile import storage

        return storage.save(self.pair[0], self.pair[1], path, sign_key=sign_key)

    def __repr__(self) -> str:
        return f"PrecompiledModule({self.model!r})"


def wrap_loaded(model: torch.nn.Module, artifact: Any) -> PrecompiledModule:
    """``model`` wrapped with an artifact ``precompile.load`` returned."""
    if not isinstance(model, torch.nn.Module) or not callable(artifact):
        raise PrecompileError(
            "precompile.module(model, artifact=...) takes an nn.Module and what precompile.load "
            f"returned, got {type(model).__name__} and {type(artifact).__name__}."
        )
    return PrecompiledModule(model, artifact)


def build_module(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    modes: tuple[str, ...] | None,
    options: Any,
) -> PrecompiledModule:
    """``model`` wrapped with the artifact of its call on the examples (see ``module_pair``)."""
    from torch_precompile import runtime

    pair = module_pair(model, example_inputs, example_kwargs, modes, options)
    return PrecompiledModule(model, runtime.load(*pair), pair)


def module_pair(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    modes: tuple[str, ...] | None,
    options: Any,
) -> tuple[str, bytes | None]:
    """Capture ``model`` called on the examples, once per mode asked for (each a variant)."""
    from torch_precompile.build import compile_variant, package
    from torch_precompile.internals.origin import describe_callable

    if not isinstance(model, torch.nn.Module):
        raise PrecompileError(
            f"precompile.module takes an nn.Module first, got {type(model).__name__}."
        )
    wanted = modes if modes is not None else (MODES[0] if model.training else MODES[1],)
    unknown = [m for m in wanted if m not in MODES]
    if unknown or not wanted:
        raise PrecompileError(f"modes must name some of {MODES}, got {modes!r}.")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise PrecompileError(
            f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}."
        )
    kwargs = dict(example_kwargs or {})
    origin = describe_callable(type(model).forward)
    was_training = model.training
    variants = []
    try:
        for mode in dict.fromkeys(wanted):
            model.train(mode == "train")
            # An eval variant serves evaluation, under no_grad: it gets no backward.
            grad = contextlib.nullcontext() if mode == "train" else torch.no_grad()
            with grad:
                variants.append(
                    compile_variant(
                        call_module,
                        (model, example_inputs, kwargs),
                        _with_grad_mode(options),
                        origin=origin,
                    )
                )
    finally:
        model.train(was_training)
    code, cache = package(variants, options)
    return code, cache


def _with_grad_mode(options: Any) -> Any:
    import dataclasses

    return dataclasses.replace(options, grad_mode=torch.is_grad_enabled())


def build_stages(
    make_stage: Callable[[int], tuple[torch.nn.Module, tuple[Any, ...]]],
    num_stages: int,
    stage_index: int,
    options: Any,
) -> PrecompiledModule:
    """Rank 0 of the default process group builds every pipeline stage's pair and sends them
    to every rank; this rank wraps its own stage (``make_stage(stage_index)``) with its pair."""
    from torch_precompile import runtime
    from torch_precompile.one_rank import build_on_rank_zero

    if not (
        isinstance(num_stages, int)
        and isinstance(stage_index, int)
        and 0 <= stage_index < num_stages
    ):
        raise PrecompileError(
            f"num_stages must be a positive int and stage_index one of 0..num_stages - 1, got "
            f"{num_stages!r} and {stage_index!r}."
        )

    def build_all() -> list[tuple[str, bytes | None]]:
        built = []
        for index in range(num_stages):
            module, examples = _made_stage(make_stage, index)
            built.append(module_pair(module, examples, None, None, options))
        return built

    pairs = build_on_rank_zero(build_all)
    module, _ = _made_stage(make_stage, stage_index)
    return PrecompiledModule(module, runtime.load(*pairs[stage_index]), pairs[stage_index])


def _made_stage(
    make_stage: Callable[[int], Any], index: int
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    made = make_stage(index)
    if not (
        isinstance(made, tuple)
        and len(made) == 2
        and isinstance(made[0], torch.nn.Module)
        and isinstance(made[1], tuple | list)
    ):
        raise PrecompileError(
            f"make_stage({index}) must return (stage module, example inputs as a tuple), got "
            f"{type(made).__name__}."
        )
    return made[0], tuple(made[1])
