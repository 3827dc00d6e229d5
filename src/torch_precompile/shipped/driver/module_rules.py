"""The rules a call's models are checked by: each model's parameters and buffers by kind,
name and tying, each submodule's class, forward and mode, and the hooks on modules, tensors
and the process, with what each refusal says. Shipped in every artifact with a model."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.tensor_rules import PrecompileError, qualified_name


def walk_owner(name: str, arguments: Sequence[str]) -> tuple[str, str]:
    """(argument, name within that model) of a walk name: with several model arguments
    (``arguments``, their names) the walk calls a member or submodule ``m<index>.<name>``."""
    if len(arguments) <= 1:
        return (arguments[0] if arguments else ""), name
    head, _, local = name.partition(".")
    return arguments[int(head[1:])], local


def shown_module(name: str, arguments: Sequence[str] = ()) -> str:
    """A submodule as messages name it, by its walk name."""
    if len(arguments) <= 1:
        return f"module {name!r}" if name else "the model"
    argument, local = walk_owner(name, arguments)
    return (
        f"module {local!r} of model argument {argument}" if local else f"model argument {argument}"
    )


def shown_member(kind: str, name: str, arguments: Sequence[str] = ()) -> str:
    """A parameter or buffer as messages name it, by its walk name."""
    if len(arguments) > 1:
        argument, local = walk_owner(name, arguments)
        return f"{kind} {local!r} of model argument {argument}"
    return f"model {kind} {name!r}"


def forward_name(module: Any) -> str | None:
    """None where ``module`` runs its class's own forward (as the class, or the base that
    defines it, wrote it); otherwise the name of what it runs instead: a forward set on the
    instance, or one patched into the class."""
    if "forward" in vars(module):
        return hook_name(vars(module)["forward"])
    for klass in type(module).__mro__:
        function = vars(klass).get("forward")
        if function is not None:
            own = klass is torch.nn.Module or (
                getattr(function, "__qualname__", None) == f"{klass.__qualname__}.forward"
                and getattr(function, "__module__", None) == klass.__module__
            )
            return None if own else hook_name(function)
    return None


def forward_error(what: str, captured: str | None, now: str | None) -> PrecompileError:
    def shown(name: str | None) -> str:
        return "its class's own forward" if name is None else f"the forward {name}"

    return PrecompileError(
        f"{what} runs {shown(now)}, but ran {shown(captured)} at capture: the artifact runs "
        "the code the captured forward ran. Set the forward back, or precompile again with "
        "this one."
    )


# Where nn.Module keeps hooks, by the kind the spec names them.
MODULE_HOOKS = (
    ("forward_pre", "_forward_pre_hooks"),
    ("forward", "_forward_hooks"),
    ("backward_pre", "_backward_pre_hooks"),
    ("backward", "_backward_hooks"),
)


GLOBAL_HOOKS = (
    ("forward_pre", "_global_forward_pre_hooks"),
    ("forward", "_global_forward_hooks"),
    ("backward_pre", "_global_backward_pre_hooks"),
    ("backward", "_global_backward_hooks"),
)


TENSOR_HOOKS = (
    ("grad", "_backward_hooks"),
    ("post_accumulate_grad", "_post_accumulate_grad_hooks"),
)


def hook_name(hook: Any) -> str:
    """A hook by the name of the code it runs (a bound method by its function, a partial by
    the function it wraps), the same in every process."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    return qualified_name(hook if hasattr(hook, "__qualname__") else type(hook))


def no_values(hook: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    """The values of hooks where the capture had none: any hook now is one too many."""
    return []


def hook_sets(
    owner: Any, places: Sequence[tuple[str, str]], values: Callable[[Any], Any] = no_values
) -> tuple[Any, ...]:
    """The hooks found on ``owner`` (a module, a tensor, or torch's module of global hooks)
    as (kind, hook labels) pairs, kinds without hooks left out: a hook by its name and the
    plain ``values`` it holds. torch.distributed's own hooks (FSDP2, distribute_module) are
    left to the parts that check sharding."""
    found = []
    for kind, attribute in places:
        hooks = getattr(owner, attribute, None)
        labels = tuple(
            hook_name(h) + "".join(f" {n}={v}" for n, v, _ in values(h))
            for h in (hooks or {}).values()
            if not hook_name(h).startswith(DISTRIBUTED_HOOKS)
        )
        if labels:
            found.append((kind, labels))
    return tuple(found)


DISTRIBUTED_HOOKS = "torch.distributed."


GLOBAL_HOOKS_OWNER = "the process (global module hooks, as register_module_forward_hook adds)"


def hooks_error(what: str, captured: Any, now: Any) -> PrecompileError:
    def shown(sets: Any) -> str:
        return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sets) or "none"

    return PrecompileError(
        f"{what} has hooks {shown(now)}, but had {shown(captured)} at capture (each hook "
        "with the plain values it holds). The artifact holds what the hooks present at "
        "capture computed with those values, so a hook added since would never run, one "
        "removed would still act and a changed value would not be seen. Register the same "
        "hooks, holding the same values, as at capture, or precompile again with the hooks "
        "you want."
    )


def members_differ(expected: tuple[str, str, str], found: tuple[str, str, str]) -> PrecompileError:
    """A model whose walk finds ``found`` (argument, kind, name) where the capture's found
    ``expected``, or found nothing more (``expected`` empty)."""
    owner, kind, local = found
    where = (
        f"where the captured model {expected[0]} has {expected[1]} {expected[2]!r}, the "
        f"runtime model has {kind} {local!r}"
        + (f" (of argument {owner})" if owner != expected[0] else "")
        if expected[0]
        else f"it has {kind} {local!r} beyond the captured model's parameters and buffers"
    )
    return PrecompileError(
        f"model argument {owner} does not match the captured model: {where}. Pass a model "
        "with the same parameters and buffers, in the same order."
    )


def check_is_model(value: Any, argument: str) -> None:
    if not isinstance(value, torch.nn.Module):
        raise PrecompileError(
            f"argument {argument} was a torch.nn.Module at capture; got "
            f"{type(value).__name__}. Pass the model in the same position."
        )


def tied_since(kind: str, name: str, owner: str) -> PrecompileError:
    """A member that is the very tensor of member ``owner`` at a call, but was not at capture."""
    return PrecompileError(
        f"model {kind} {name!r} is tied to {owner!r} at runtime but was a separate "
        "tensor at capture. Use a model with the same weight tying."
    )


def tied_apart(kind: str, name: str, tied_to: str) -> PrecompileError:
    """A member tied to another at capture that is a tensor of its own now."""
    return PrecompileError(
        f"model {kind} {name!r} was tied to {tied_to!r} at capture; at runtime it is a "
        "separate tensor. Tie the weights as in the example model."
    )


def members_missing(missing: Sequence[str]) -> PrecompileError:
    """The parameters and buffers (``kind 'name'``) a runtime model lacks."""
    return PrecompileError(
        f"the runtime model lacks {', '.join(missing[:5])}"
        f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
        "model with the same parameters and buffers."
    )


def submodules_differ(names: Sequence[str], captured: Sequence[str]) -> PrecompileError:
    """The submodule names a walk found, where the capture's were ``captured``."""
    added = sorted(set(names) - set(captured))
    return PrecompileError(
        "the runtime model's submodules differ from the captured model's"
        + (f" (new: {', '.join(repr(n or '<root>') for n in added[:5])})" if added else "")
        + ". Pass a model with the same modules as the example."
    )


def check_module(
    module: Any,
    name: str,
    cls: str | None,
    forward: str | None = None,
    training: bool = True,
    arguments: Sequence[str] = (),
) -> None:
    """One submodule (``name`` in the walk of the model ``arguments``) against its captured
    class, forward and mode."""
    shown = shown_module(name, arguments)
    if cls is not None and qualified_name(type(module)) != cls:
        raise PrecompileError(
            f"{shown} is a {qualified_name(type(module))}, but was a {cls} at "
            "capture: the artifact runs the code the captured class ran. Pass a model "
            "built like the example, or precompile again with this one."
        )
    if cls is not None and forward_name(module) != forward:
        raise forward_error(shown, forward, forward_name(module))
    if module.training != training:
        mode, fix = ("training", ".train()") if training else ("eval", ".eval()")
        raise PrecompileError(
            f"{shown} is in {'training' if module.training else 'eval'} mode, "
            f"but was captured in {mode} mode (dropout and BatchNorm behave differently). Call "
            f"{fix} on the model before calling the artifact, or precompile again in this "
            "mode."
        )
