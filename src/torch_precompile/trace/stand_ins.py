"""Builds without the weights: fake tensors stand in for a model's weights and the inputs.

A model created on the ``meta`` device (``with torch.device("meta"): model = Net()``) holds
no values; neither does one created under a ``FakeTensorMode``. Such a model, with example
inputs of the same kind, is captured on fake tensors of the device the artifact will run on:
the trace and the lowering see shapes, dtypes and that device, and nothing of the size of the
weights is ever allocated. The artifact is the one a build with real weights would give, and
every call passes the real model, as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.internals.tracing import (
    FakeTensor,
    FakeTensorMode,
    fake_with_layout,
    view_base,
)


@dataclass(frozen=True)
class StandIns:
    """How a build without the weights traces: on fakes of ``fake_mode``, on ``device``."""

    fake_mode: FakeTensorMode
    device: torch.device


@dataclass
class _Found:
    """The tensors of the arguments that hold no values, and what the fake ones agree on."""

    meta: int = 0
    fake_modes: tuple[FakeTensorMode, ...] = ()
    fake_devices: tuple[torch.device, ...] = ()
    real: tuple[str, ...] = ()  # where a real tensor sits among them (for the refusal)

    def note(self, tensor: torch.Tensor, where: str) -> None:
        if isinstance(tensor, FakeTensor):
            if tensor.fake_mode not in self.fake_modes:
                self.fake_modes = (*self.fake_modes, tensor.fake_mode)
            if tensor.device not in self.fake_devices:
                self.fake_devices = (*self.fake_devices, tensor.device)
        elif tensor.is_meta:
            self.meta += 1
        elif len(self.real) < 1:
            self.real = (*self.real, where)

    @property
    def any(self) -> bool:
        return bool(self.meta or self.fake_modes)


@contextlib.contextmanager
def standing_in(
    args: tuple[Any, ...], device: str | torch.device | None
) -> Iterator[tuple[tuple[Any, ...], StandIns | None]]:
    """``args`` with fakes on the target device for their meta tensors, and how to trace them.

    A module argument's meta parameters and buffers are replaced in place for the build and
    put back after it; the input tensors are replaced in the returned arguments. Without any
    meta or fake tensor the arguments come back as they are (``None``: a build as usual).
    """
    found = _survey(args)
    target = _target_device(found, device)
    if target is None:
        yield args, None
        return
    # Graphs hold real constants (a literal, a scalar a decomposition lifts), met by fakes
    # when a traced graph is run again (the differentiable form's backward): let them mix.
    fake_mode = found.fake_modes[0] if found.fake_modes else FakeTensorMode()
    allowed, fake_mode.allow_non_fake_inputs = fake_mode.allow_non_fake_inputs, True
    swapped: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    try:
        made: dict[int, torch.Tensor] = {}

        def stand_in(leaf: Any) -> Any:
            meta = isinstance(leaf, torch.Tensor) and leaf.is_meta
            return _stand_in(leaf, fake_mode, target, made) if meta else leaf

        for module in (a for a in args if isinstance(a, torch.nn.Module)):
            for sub in module.modules():
                own = (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False))
                for name, tensor in own:
                    if tensor.is_meta:
                        swapped.append((sub, name, tensor))
                        setattr(sub, name, stand_in(tensor))  # a buffer stays one
        converted = tuple(
            a
            if isinstance(a, (torch.nn.Module, torch.optim.Optimizer))
            else pytree.tree_map(stand_in, a)
            for a in args
        )
        yield converted, StandIns(fake_mode, target)
    finally:
        for sub, name, tensor in reversed(swapped):
            setattr(sub, name, tensor)
        fake_mode.allow_non_fake_inputs = allowed


def _survey(args: tuple[Any, ...]) -> _Found:
    found = _Found()
    for position, arg in enumerate(args):
        if isinstance(arg, torch.nn.Module):
            for name, tensor in (*arg.named_parameters(), *arg.named_buffers()):
                found.note(tensor, f"model tensor {name!r}")
        elif isinstance(arg, torch.optim.Optimizer):
            continue
        else:
            for leaf in pytree.tree_leaves(arg):
                if isinstance(leaf, torch.Tensor):
                    found.note(leaf, f"argument {position}")
    if any(isinstance(a, torch.optim.Optimizer) for a in args) and found.any:
        raise PrecompileError(
            "an optimizer steps inside fn, and the model's weights are meta or fake tensors; a "
            "build without the weights takes no optimizer yet (its state is made from the "
            "weights' values). Build the training step with the real model, or build the "
            "inference artifact without the weights."
        )
    return found


def _target_device(found: _Found, device: str | torch.device | None) -> torch.device | None:
    """The device the artifact runs on, or None for a build with the weights themselves."""
    named = None if device is None else _device(device)
    if not found.any:
        if named is not None:
            raise PrecompileError(
                f"device={str(named)!r} names the device a build without the weights is for, "
                "but no tensor of the arguments is on the meta device or fake: the artifact is "
                "for the device the real tensors are on. Leave device out, or create the model "
                "and the example inputs on the meta device (with torch.device('meta'): ...)."
            )
        return None
    if len(found.fake_modes) > 1:
        raise PrecompileError(
            "the arguments hold fake tensors of more than one FakeTensorMode; create the model "
            "and the example inputs under one mode."
        )
    if found.real:
        raise PrecompileError(
            f"{found.real[0]} is a real tensor, while other tensors of the arguments are meta or "
            "fake stand-ins for a build without the weights. Give every tensor the same way: all "
            "on the meta device (or all fake), or all real."
        )
    if found.fake_devices and (len(found.fake_devices) > 1 or found.meta):
        raise PrecompileError(
            "the arguments mix meta tensors and fake tensors (or fakes of several devices); "
            "create the model and the example inputs one way: all on the meta device, or all "
            "under one FakeTensorMode on the device the artifact runs on."
        )
    if found.fake_devices:
        fake_device = found.fake_devices[0]
        if named is not None and named != fake_device:
            raise PrecompileError(
                f"device={str(named)!r}, but the fake tensors of the arguments are on "
                f"{fake_device}; leave device out (fakes name their device), or create them "
                f"on {named}."
            )
        return _supported(fake_device)
    if named is None:
        raise PrecompileError(
            "the model's weights (or the example inputs) are on the meta device: they hold no "
            "values, and a meta artifact could run nothing. Name the device the artifact will "
            "run on (precompile(fn, model, x, device='cpu')), and the build traces on stand-ins "
            "of that device without allocating the weights."
        )
    if named.type == "meta":
        raise PrecompileError(
            "device='meta' names no device an artifact can run on; name the one the real model "
            "will be on (device='cpu', device='cuda')."
        )
    return _supported(named)


def _supported(device: torch.device) -> torch.device:
    """``device``, where this torch build can trace on its stand-ins."""
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        raise PrecompileError(
            f"device={str(device)!r} names a device this torch build has no support for: an "
            "operation on its stand-ins would abort the process. Build with a torch that "
            "supports it (a CUDA build of torch runs without a GPU), or name device='cpu'."
        )
    return device


def _device(device: str | torch.device) -> torch.device:
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise PrecompileError(f"device={device!r} is not a device torch knows: {e}") from e
    if named.type == "cuda" and named.index is None:
        named = torch.device("cuda", 0)
    return named


def _stand_in(
    tensor: torch.Tensor,
    fake_mode: FakeTensorMode,
    device: torch.device,
    made: dict[int, torch.Tensor],
) -> torch.Tensor:
    """A fake of ``tensor`` on ``device``, the same one for the same tensor (tied weights)."""
    known = made.get(id(tensor))
    if known is not None:
        return known
    base = view_base(tensor)
    if base is not None:  # a view stays a view of its base's stand-in
        whole = _stand_in(base, fake_mode, device, made).detach()
        with fake_mode:
            fake = whole.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    else:
        fake = fake_with_layout(fake_mode, tensor, device)
    fake = (
        torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        if isinstance(tensor, torch.nn.Parameter)
        else fake.requires_grad_(tensor.requires_grad)
    )
    made[id(tensor)] = fake
    return fake
