"""Model state lifted to graph inputs: parameters and buffers of every module argument."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_precompile.shipped.driver.module_rules import forward_name
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import HookSet, ModelTensor, Submodule
from torch_precompile.trace.facts.hooks import tensor_hooks


@dataclass(frozen=True)
class ModelState:
    """Parameters then buffers of all module arguments, interned by tensor identity.

    ``tensors`` holds each distinct tensor once (tied weights are one graph input and get one
    gradient); ``tied_names`` maps every further name of an already-seen tensor to its first
    name; ``bindings[i]`` maps module ``i``'s local names to indices into ``tensors``;
    ``members`` lists (kind, name, index into ``tensors``) in walk order, tied names included.
    """

    tensors: list[torch.Tensor]
    param_names: list[str]
    buffer_names: list[str]
    tied_names: dict[str, str]
    bindings: list[dict[str, int]]
    members: list[tuple[str, str, int]]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


def intern_model_state(modules: list[torch.nn.Module]) -> ModelState:
    """Walk ``modules`` in the order the driver repeats at every call."""
    qualify = len(modules) > 1
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}
    names: dict[str, list[str]] = {"parameter": [], "buffer": []}
    tied: dict[str, str] = {}
    bindings: list[dict[str, int]] = [{} for _ in modules]
    members: list[tuple[str, str, int]] = []
    for kind in ("parameter", "buffer"):
        for mi, module in enumerate(modules):
            named = (
                module.named_parameters(remove_duplicate=False)
                if kind == "parameter"
                else module.named_buffers(remove_duplicate=False)
            )
            for local, tensor in named:
                name = f"m{mi}.{local}" if qualify else local
                index = index_of.get(id(tensor))
                if index is None:
                    index = index_of[id(tensor)] = len(tensors)
                    tensors.append(tensor)
                    names[kind].append(name)
                else:
                    tied[name] = _name_at(index, names)
                bindings[mi][local] = index
                members.append((kind, name, index))
    return ModelState(tensors, names["parameter"], names["buffer"], tied, bindings, members)


def model_records(
    state: ModelState,
    grad_indices: list[int],
    training: bool,
    old_grads: Callable[[int], str | None] = lambda index: None,
) -> tuple[ModelTensor, ...]:
    """One spec record per member name, in walk order; strides are the lowering's to set.
    A training step's parameters carry their tensor hooks, which its backward ran, and what
    fn does with the gradient a call finds (``old_grads``, by flat index)."""
    records = []
    for kind, name, index in state.members:
        tensor = state.tensors[index]
        records.append(
            ModelTensor(
                name=name,
                kind=kind,
                tied_to=state.tied_names.get(name),
                shape=tuple(tensor.shape),
                dtype=str(tensor.dtype),
                device=str(tensor.device),
                strides=None,
                requires_grad=tensor.requires_grad,
                gets_grad=index in grad_indices,
                hooks=tensor_hooks(tensor) if training and kind == "parameter" else (),
                old_grad=old_grads(index) if kind == "parameter" else None,
            )
        )
    return tuple(records)


def submodule_records(
    modules: list[torch.nn.Module], hooks: Sequence[tuple[HookSet, ...]]
) -> tuple[Submodule, ...]:
    """Every module reached from the model arguments: its training flag, class and hooks
    (``hooks`` as taken before the trace, in the same walk order)."""
    qualify = len(modules) > 1
    found = [
        (f"m{mi}.{name}" if qualify else name, module)
        for mi, root in enumerate(modules)
        for name, module in root.named_modules(remove_duplicate=False)
    ]
    return tuple(
        Submodule(
            name, module.training, qualified_name(type(module)), module_hooks, forward_name(module)
        )
        for (name, module), module_hooks in zip(found, hooks, strict=True)
    )


def _name_at(index: int, names: dict[str, list[str]]) -> str:
    params = names["parameter"]
    return params[index] if index < len(params) else names["buffer"][index - len(params)]
