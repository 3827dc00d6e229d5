"""Optimizer arguments: their state lifted to graph inputs, their learning rates read per call.

An optimizer passed to ``fn`` is to its state what a model is to its weights. Each state
tensor it keeps for a parameter (a momentum buffer, ``exp_avg``, ``step``) becomes a flat graph
input that the graph updates in place, like a BatchNorm buffer; each param group's ``lr``
becomes a 0-dim float64 input, so a schedule needs no recapture; every other option is baked
and checked at every call.

A fresh optimizer creates its state on its first step. For the classes carried here that
state starts at zero and the update from zero state is the first step (Adam's bias
corrections count from its ``step`` tensor; SGD's first momentum buffer is the gradient, which
``momentum * 0 + grad`` reproduces exactly when there is no dampening). So the graph is always
the step from existing state, traced on zeros where the example optimizer has none, and the
driver gives a fresh optimizer zero state before the call.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.optim import step_count_dtype, step_hooks
from torch_precompile.internals.tracing import compiling
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import EncodedValue, Optimizer, OptimizerState, ParamGroup
from torch_precompile.trace.state import ModelState
from torch_precompile.trace.values import Use, encode

CALL_TIME_OPTIONS = ("lr",)
"""Options read from each param group at every call; every other option is baked."""

_Group = dict[str, Any]


@dataclass(frozen=True)
class _Rule:
    """What capture knows of one optimizer class: the state its step keeps per parameter, the
    options it is traced with (forms whose ``lr`` may be a tensor without ``.item()``), and
    whether a parameter without state may start from zeros."""

    state_keys: Callable[[_Group], tuple[str, ...]]
    traced_options: Callable[[_Group, bool], _Group]  # (group, for Inductor)
    fresh_start: Callable[[_Group], str | None]


def _adam_keys(group: _Group) -> tuple[str, ...]:
    return ("step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group["amsgrad"] else ()))


# Inductor has no lowering for the fused kernels (_fused_adamw_, _fused_sgd_); it fuses the
# foreach form's update itself.
def _adam_traced(group: _Group, inductor: bool) -> _Group:
    # The capturable form computes bias corrections from the step tensor and takes a tensor lr.
    if group["fused"] and not inductor:
        return {}
    return {"capturable": True, "fused": False, "foreach": True}


def _sgd_traced(group: _Group, inductor: bool) -> _Group:
    # The foreach form multiplies by a tensor lr; the single-tensor one would read it as a float.
    if group["fused"] and not inductor:
        return {}
    return {"foreach": True, "fused": False}


def _sgd_fresh_start(group: _Group) -> str | None:
    if group["momentum"] == 0 or group["dampening"] == 0:
        return None
    return (
        "SGD with dampening starts its momentum buffer from the undamped gradient on the "
        "first step, which the captured update (from an existing buffer) does not do. Take "
        "the first step with opt.step() outside the artifact, then call it; or use "
        "dampening=0."
    )


_ADAM = _Rule(_adam_keys, _adam_traced, lambda group: None)
_RULES: dict[type, _Rule] = {
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
    torch.optim.SGD: _Rule(
        lambda g: ("momentum_buffer",) if g["momentum"] != 0 else (), _sgd_traced, _sgd_fresh_start
    ),
}


@dataclass(frozen=True)
class StateEntry:
    """One lifted state tensor: its parameter (an index into the model state) and key."""

    param: int
    key: str
    example: torch.Tensor  # the optimizer's own tensor, or zeros where it has none yet


@dataclass
class OptimizerArg:
    """An optimizer argument of fn, as capture lifts it."""

    name: str
    optimizer: torch.optim.Optimizer
    entries: list[StateEntry]
    inductor: bool
    stepped: set[int] = field(default_factory=set)  # params that had a gradient at its step
    zero_grad_first: bool = False  # fn called zero_grad() before any gradient existed


def refuse_returned_lrs(optimizers: Sequence[OptimizerArg], leaves: Sequence[Any]) -> None:
    """Refuse a result that is a param group's lr as fn read it: lr is read at every call for
    the step, but a result leaf is baked, so the artifact would return the capture's lr after
    a scheduler had changed it."""
    for arg in optimizers:
        for number, group in enumerate(arg.optimizer.param_groups):
            lr = group.get("lr")
            at = [i for i, leaf in enumerate(leaves) if type(leaf) is float and leaf is lr]
            if at:
                raise PrecompileError(
                    f"fn's result holds the lr of param group {number} of optimizer "
                    f"{arg.name} ({lr}) at leaf {at[0]}: the artifact reads lr at every call "
                    "for the step, but would return this value as it was at capture. Read it "
                    f"after the call, outside fn ({arg.name}.param_groups[{number}]['lr'])."
                )


def read_optimizers(
    args: Sequence[Any], arg_names: Sequence[str], state: ModelState, backend: str
) -> list[OptimizerArg]:
    """The optimizer arguments, each checked: a class carried here, no step hooks, steps only
    model parameters, state as its class keeps it."""
    found = []
    param_index = {id(t): i for i, t in enumerate(state.tensors[: state.num_params])}
    for arg, name in zip(args, arg_names, strict=True):
        if isinstance(arg, torch.optim.Optimizer):
            _refuse_class(arg, name)
            _refuse_step_hooks(arg, name)
            entries = list(_entries(arg, name, param_index, state))
            found.append(OptimizerArg(name, arg, entries, backend == "inductor"))
    return found


def _refuse_class(optimizer: torch.optim.Optimizer, name: str) -> None:
    cls = type(optimizer)
    if cls not in _RULES:
        carried = ", ".join(f"torch.optim.{c.__name__}" for c in _RULES)
        raise PrecompileError(
            f"optimizer {name} is a {qualified_name(cls)}; a step inside fn is "
            f"carried for {carried}, whose state and first step capture knows. Call "
            f"{name}.step() outside the artifact (loss = run(model, x, t); {name}.step(); "
            f"{name}.zero_grad()), or use one of those."
        )
    for index, group in enumerate(optimizer.param_groups):
        for option, value in group.items():
            if option not in ("params", *CALL_TIME_OPTIONS) and isinstance(value, torch.Tensor):
                raise PrecompileError(
                    f"option {option!r} of param group {index} of optimizer {name} is a tensor; "
                    "only lr is read at every call, other options are baked as Python numbers. "
                    f"Set {option} to a float."
                )
        if group.get("differentiable"):
            raise PrecompileError(
                f"param group {index} of optimizer {name} has differentiable=True; a step "
                "inside fn is carried without autograd through the update. Use "
                "differentiable=False."
            )


def _refuse_step_hooks(optimizer: torch.optim.Optimizer, name: str) -> None:
    hooks = step_hooks(optimizer)
    if hooks:
        raise PrecompileError(
            f"optimizer {name} has {hooks}; they run around an eager opt.step(), and an "
            "artifact would run them once, at capture. Remove them (handle.remove()), or call "
            f"{name}.step() outside the artifact."
        )


def _entries(
    optimizer: torch.optim.Optimizer, name: str, param_index: dict[int, int], state: ModelState
) -> Iterator[StateEntry]:
    rule = _RULES[type(optimizer)]
    for index, group in enumerate(optimizer.param_groups):
        keys = rule.state_keys(group)
        for param in group["params"]:
            where = param_index.get(id(param))
            if where is None:
                raise PrecompileError(
                    f"param group {index} of optimizer {name} holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model arguments; a "
                    "step inside fn updates model parameters only. Build the optimizer over "
                    "model.parameters()."
                )
            held = optimizer.state.get(param)
            if held:
                _refuse_held_state(held, keys, name, state.param_names[where])
            for key in keys:
                example = held[key] if held else _zeros(key, param, group)
                yield StateEntry(where, key, example)


def _refuse_held_state(held: dict[str, Any], keys: tuple[str, ...], name: str, param: str) -> None:
    if tuple(sorted(held)) != tuple(sorted(keys)):
        raise PrecompileError(
            f"optimizer {name} holds state {sorted(held)} for parameter {param!r}, where its "
            f"options keep {sorted(keys)}. Load a state dict saved with the same options."
        )
    for key, value in held.items():
        if not isinstance(value, torch.Tensor):
            raise PrecompileError(
                f"optimizer {name} holds {key!r} of parameter {param!r} as a "
                f"{type(value).__name__}; a step inside fn reads its state as tensors (as "
                "torch.optim does since 1.12). Load a state dict saved by this torch."
            )


def _zeros(key: str, param: torch.Tensor, group: _Group) -> torch.Tensor:
    """The value the optimizer's first step would create for ``key`` before updating it."""
    if key == "step":  # as torch.optim's Adam creates it
        dtype = step_count_dtype(group.get("fused"))
        on_param = group.get("capturable") or group.get("fused")
        return torch.zeros((), dtype=dtype, device=param.device if on_param else "cpu")
    return torch.zeros_like(param, memory_format=torch.preserve_format)


@contextlib.contextmanager
def stepping(
    optimizers: Sequence[OptimizerArg],
    state: Sequence[torch.Tensor],
    lrs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    originals: Sequence[torch.Tensor],
) -> Iterator[None]:
    """While fn is traced: each optimizer steps the traced ``params`` (which stand for the
    model's ``originals``; a DTensor's are rebuilt around its local tensor) and holds the
    lifted ``state`` tensors, and its step runs with the ``lrs`` tensors and its traced
    options, recording which parameters it steps."""
    states, lr_inputs = iter(state), iter(lrs)
    traced = {id(p): params[i] for i, p in enumerate(originals[: len(params)])}
    restore: list[Callable[[], None]] = []
    try:
        for arg in optimizers:
            lifted: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            for entry in arg.entries:
                lifted[params[entry.param]][entry.key] = next(states)
            group_lrs = [next(lr_inputs) for _ in arg.optimizer.param_groups]
            restore.append(_install(arg, lifted, group_lrs, params))
            restore.append(_stepping_traced(arg.optimizer, traced))
        yield
    finally:
        for undo in reversed(restore):
            undo()


@contextlib.contextmanager
def only_arguments_step(optimizers: Sequence[OptimizerArg]) -> Iterator[None]:
    """While fn is traced, an optimizer that is not an argument of fn (a global, a closure
    value, an attribute) must not step: its state lives outside what the artifact takes, so
    the graph would bake its first step (state from zero, step count 1) and replay it at every
    call, where eager would go on from the state it keeps."""
    passed = {id(o.optimizer) for o in optimizers}

    def refuse(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if id(optimizer) not in passed:
            cls = type(optimizer)
            raise PrecompileError(
                f"fn steps a {qualified_name(cls)} that is not one of its "
                "arguments (a global, a closure value or an attribute): the artifact would "
                "replay the step from the state it had at capture at every call. Pass the "
                "optimizer as an argument, as the model is: fn(model, opt, x, ...) and "
                "precompile(fn, model, opt, x, ...); or step it outside fn."
            )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


def _stepping_traced(
    optimizer: torch.optim.Optimizer, traced: dict[int, torch.Tensor]
) -> Callable[[], None]:
    """Each param group holds the traced parameters until the returned undo."""
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [traced[id(p)] for p in group["params"]]

    def undo() -> None:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params

    return undo


def _install(
    arg: OptimizerArg,
    lifted: defaultdict[torch.Tensor, dict[str, Any]],
    lrs: list[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> Callable[[], None]:
    optimizer, rule = arg.optimizer, _RULES[type(arg.optimizer)]
    saved_state, own = optimizer.state, vars(optimizer).get("step")
    inner = optimizer.step  # a scheduler's wrapper, or the bound method
    index_of = {id(p): i for i, p in enumerate(params)}
    expected = {id(p): (dict(entries)) for p, entries in lifted.items()}

    def traced_step(*args: Any, **kwargs: Any) -> Any:
        saved = [dict(group) for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group.update(rule.traced_options(group, arg.inductor), lr=lr)
            arg.stepped.update(index_of[id(p)] for p in group["params"] if p.grad is not None)
        try:
            with compiling():
                return inner(*args, **kwargs)
        finally:
            for group, options in zip(optimizer.param_groups, saved, strict=True):
                group.update(options)

    own_zero_grad, inner_zero_grad = vars(optimizer).get("zero_grad"), optimizer.zero_grad

    def traced_zero_grad(*args: Any, **kwargs: Any) -> Any:
        # The trace starts with no gradients: a zero_grad() seeing none comes before backward.
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            arg.zero_grad_first = True
        return inner_zero_grad(*args, **kwargs)

    optimizer.state = lifted
    optimizer.step = traced_step  # type: ignore[method-assign]
    optimizer.zero_grad = traced_zero_grad  # type: ignore[method-assign]

    def undo() -> None:
        optimizer.state = saved_state
        for attribute, value in (("step", own), ("zero_grad", own_zero_grad)):
            if value is None:
                vars(optimizer).pop(attribute, None)
            else:
                setattr(optimizer, attribute, value)
        _refuse_changed_state(arg.name, lifted, expected, params)

    return undo


def _refuse_changed_state(
    name: str,
    lifted: dict[torch.Tensor, dict[str, Any]],
    expected: dict[int, dict[str, Any]],
    params: Sequence[torch.Tensor],
) -> None:
    """The step must update the lifted tensors in place: anything it adds or replaces would be
    created once, at capture."""
    for param, entries in lifted.items():
        before = expected.get(id(param), {})
        if entries.keys() != before.keys() or any(entries[k] is not before[k] for k in entries):
            raise PrecompileError(
                f"optimizer {name}'s step replaced or added state {sorted(entries)} of a "
                "parameter instead of updating it in place; an artifact would create it once, "
                "at capture. Call its step outside the artifact."
            )
    if len(lifted) != len(expected):
        raise PrecompileError(
            f"optimizer {name}'s step created state for parameters capture did not lift; call "
            "its step outside the artifact."
        )


def optimizer_records(
    optimizers: Sequence[OptimizerArg], state: ModelState
) -> tuple[tuple[Optimizer, ...], tuple[ParamGroup, ...], tuple[OptimizerState, ...]]:
    """The spec records of the optimizers; state entries of parameters never stepped are
    dropped (the caller drops their flat inputs too)."""
    names = state.param_names
    entries: list[OptimizerState]
    records, groups, entries = [], [], []
    for number, arg in enumerate(optimizers):
        optimizer = arg.optimizer
        cls = type(optimizer)
        records.append(Optimizer(arg.name, qualified_name(cls), arg.zero_grad_first))
        rule = _RULES[cls]
        index_of = {id(t): i for i, t in enumerate(state.tensors)}
        for group in optimizer.param_groups:
            options = sorted(k for k in optimizer.defaults if k not in CALL_TIME_OPTIONS)
            groups.append(
                ParamGroup(
                    optimizer=number,
                    params=tuple(names[index_of[id(p)]] for p in group["params"]),
                    call_time=CALL_TIME_OPTIONS,
                    baked=tuple((k, _baked(arg.name, k, group[k])) for k in options),
                    fresh_start=rule.fresh_start(group),
                )
            )
        entries.extend(
            OptimizerState(
                number,
                names[e.param],
                e.key,
                tuple(e.example.shape),
                str(e.example.dtype),
                str(e.example.device),
            )
            for e in arg.entries
            if e.param in arg.stepped
        )
    return tuple(records), tuple(groups), tuple(entries)


def _baked(name: str, option: str, value: Any) -> EncodedValue:
    encoded = encode(value, Use.OPTION)
    if encoded is not None:
        return encoded
    raise PrecompileError(
        f"option {option!r} of optimizer {name} is a {type(value).__name__}; options other "
        "than lr are baked and compared at every call, so they must be numbers, strings, "
        "None or tuples of those."
    )


def kept_entries(optimizers: Sequence[OptimizerArg]) -> list[bool]:
    """For each lifted state tensor in flat order, whether its parameter was stepped."""
    return [e.param in arg.stepped for arg in optimizers for e in arg.entries]
