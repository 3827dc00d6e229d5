"""Facts a trace bakes in beyond the tensors: submodule classes, hooks, Python values read,
requires_grad, grad mode, ambient state (autocast, default dtype, deterministic algorithms,
dispatch modes) and aliasing. A call where one differs from capture is refused, naming it,
and leaves every tensor as it was; a call where they hold computes what eager fn computes.

Each docstring gives, as "before", what such a call did before these checks: ran, no error,
and returned or wrote wrong numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torch_precompile import PrecompileError, precompile

from conftest import assert_same, model_state

SHIFT = 1.0  # a global the traced code reads


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def new_x() -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float32)


def build(fn: Callable[..., Any], *args: Any, backend: str) -> Callable[..., Any]:
    return precompile.load(*precompile(fn, *args, backend=backend))


def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def train_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def double_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def triple_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


def snapshot(*things: Any) -> dict[str, Any]:
    """Every tensor of ``things``: a module's parameters, .grad and buffers, an optimizer's
    state, a tensor itself; cloned."""
    state: dict[str, Any] = {}
    for i, thing in enumerate(things):
        if isinstance(thing, nn.Module):
            state.update({f"{i}.{k}": v for k, v in model_state(thing).items()})
        elif isinstance(thing, torch.optim.Optimizer):
            for j, group in enumerate(thing.param_groups):
                for k, p in enumerate(group["params"]):
                    for key, value in thing.state.get(p, {}).items():
                        state[f"{i}.{j}.{k}.{key}"] = (
                            value.clone() if torch.is_tensor(value) else value
                        )
        else:
            state[str(i)] = thing.detach().clone()
    return state


def assert_identical(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if torch.is_tensor(value):
            assert torch.equal(value, after[key]), f"{key} changed"
        else:
            assert value == after[key], f"{key} changed"


@contextmanager
def refused(match: str, *things: Any) -> Iterator[None]:
    """The block raises PrecompileError matching ``match``; every tensor of ``things`` is
    bitwise as before it."""
    before = snapshot(*things)
    with pytest.raises(PrecompileError, match=match):
        yield
    assert_identical(before, snapshot(*things))


@contextmanager
def refused_while_set(
    owner: Any, name: str, value: Any, match: str, *things: Any
) -> Iterator[None]:
    """``owner.name`` is ``value`` in the block, which ``refused(match, *things)``; then it is
    set back."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        with refused(match, *things):
            yield
    finally:
        setattr(owner, name, old)


def agree(
    run: Callable[..., Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    eager_args: tuple[Any, ...],
) -> None:
    """The artifact on ``args`` and eager fn on ``eager_args`` (twins of them) give the same
    result and leave the same tensors behind."""
    assert_same(run(*args), fn(*eager_args))
    assert_same(snapshot(*args), snapshot(*eager_args))


def test_submodule_class_swap_is_refused(backend: str) -> None:
    """A submodule of another class with the same parameters (Tanh for ReLU) is refused,
    naming the module and both classes. Before: off by 0.65, no error."""
    model, other = mlp(0), mlp(1)
    run = build(forward, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, forward, (m, x), (m, x))
    model[1] = nn.Tanh()
    x = new_x()
    with refused(
        r"module '1' is a torch\.nn\.modules\.activation\.Tanh, but was a "
        r"torch\.nn\.modules\.activation\.ReLU at capture",
        model,
        x,
    ):
        run(model, x)
    model[1] = nn.ReLU()
    x = new_x()
    agree(run, forward, (model, x), (model, x))


def test_module_hooks_added_after_capture_are_refused(backend: str) -> None:
    """A forward hook added after capture (on a module, or process-wide) is refused.
    Before: off by 0.26, no error (the hook never ran)."""
    model, other = mlp(0), mlp(1)
    run = build(forward, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, forward, (m, x), (m, x))
    handle = model[0].register_forward_hook(double_output)
    try:
        x = new_x()
        with refused(
            r"module '0' has hooks forward: \S*double_output, but had none at "
            "capture",
            model,
            x,
        ):
            run(model, x)
    finally:
        handle.remove()
    handle = nn.modules.module.register_module_forward_hook(double_output)
    try:
        x = new_x()
        with refused(
            r"the process \(global module hooks.*\) has hooks forward: \S*double_output, "
            "but had none at capture",
            other,
            x,
        ):
            run(other, x)
    finally:
        handle.remove()
    x = new_x()
    agree(run, forward, (other, x), (other, x))


def test_module_hooks_present_at_capture(backend: str) -> None:
    """A forward hook that keeps activations in a dict is refused at capture, the dict left
    empty (before: the dict was never filled). A hook present at capture that only computes
    runs in the artifact; removing it after capture is refused (before: off by 0.21)."""
    model, other = mlp(0), mlp(1)
    feats: dict[str, torch.Tensor] = {}

    def store(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        feats["act"] = output

    handle = model[0].register_forward_hook(store)
    try:
        with refused(
            r"fn changed the 'feats' it closes over, which forward hook \S*store "
            "reaches, while it was traced",
            model,
        ):
            precompile(forward, model, new_x(), backend=backend)
    finally:
        handle.remove()
    assert feats == {}
    handles = [m[0].register_forward_hook(double_output) for m in (model, other)]
    try:
        run = build(forward, model, new_x(), backend=backend)
        for m in (model, other, model):
            x = new_x()
            agree(run, forward, (m, x), (m, x))
    finally:
        handles[0].remove()
    x = new_x()
    with refused(
        r"module '0' has hooks none, but had forward: \S*double_output at capture", model, x
    ):
        run(model, x)
    handles[1].remove()
    x = new_x()
    with refused(r"module '0' has hooks none", other, x):
        run(other, x)


def test_tensor_hooks_on_parameters(backend: str) -> None:
    """In a training step, Tensor.register_hook on a parameter after capture is refused
    (before: gradients off by 7.7e-2); the same hook present at capture acts as in eager, and
    removing it is refused."""
    model, other = mlp(0), mlp(1)
    twin, other_twin = copy.deepcopy(model), copy.deepcopy(other)
    run = build(train_step, model, new_x(), backend=backend)
    for m, t in ((model, twin), (other, other_twin), (model, twin)):
        x = new_x()
        agree(run, train_step, (m, x), (t, x))
    handle = model[0].weight.register_hook(triple_grad)
    try:
        x = new_x()
        with refused(
            r"model parameter '0\.weight' has hooks grad: \S*triple_grad, but had "
            "none at capture",
            model,
            x,
        ):
            run(model, x)
    finally:
        handle.remove()

    handles = [m[0].weight.register_hook(triple_grad) for m in (model, twin, other, other_twin)]
    try:
        hooked = build(train_step, model, new_x(), backend=backend)
        for m, t in ((model, twin), (other, other_twin), (model, twin)):
            x = new_x()
            agree(hooked, train_step, (m, x), (t, x))
    finally:
        handles[0].remove()
    x = new_x()
    with refused(
        r"model parameter '0\.weight' has hooks none, but had grad: \S*triple_grad "
        "at capture",
        model,
        x,
    ):
        hooked(model, x)
    x = new_x()
    agree(hooked, train_step, (other, x), (other_twin, x))
    for h in handles[1:]:
        h.remove()


class Config:
    """A plain config object a module reads from."""

    def __init__(self) -> None:
        self.eps = 1e-5


class Adapter(nn.Module):
    """Reads Python values in forward: a LoRA-style scaling, a dropout p (in training), a
    nested config value and a module global."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.0)
        self.scaling = 0.5
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x)) * self.scaling
        return h / (h.pow(2).mean(-1, keepdim=True) + self.config.eps).sqrt() + SHIFT


def test_python_values_read_by_the_trace(backend: str) -> None:
    """Each Python value the trace read must be the captured one: a module attribute
    (LoRA-style scaling; before: off by 1.6e-2 to 0.9, no error), a nested config attribute
    and a module global. Set back, the artifact runs again."""
    global SHIFT
    model, other = Adapter(0), Adapter(1)
    run = build(forward, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, forward, (m, x), (m, x))

    model.scaling = 2.0
    x = new_x()
    with refused(
        r"attribute 'scaling' of the model is 2\.0, but was 0\.5 when the trace "
        "read it",
        model,
        x,
    ):
        run(model, x)
    model.scaling = 0.5
    x = new_x()
    agree(run, forward, (model, x), (model, x))

    other.config.eps = 1.0
    x = new_x()
    with refused(r"attribute 'config\.eps' of the model is 1\.0, but was 1e-05", other, x):
        run(other, x)
    other.config.eps = 1e-5

    SHIFT = 3.0
    try:
        x = new_x()
        with refused(rf"global 'SHIFT' of module {__name__} is 3\.0, but was 1\.0", model, x):
            run(model, x)
    finally:
        SHIFT = 1.0
    this = sys.modules[__name__]
    this.SHIFT = -1.0  # the same, written as a module attribute
    try:
        x = new_x()
        with refused(r"global 'SHIFT' .* is -1\.0, but was 1\.0", other, x):
            run(other, x)
    finally:
        this.SHIFT = 1.0
    for m in (model, other):
        x = new_x()
        agree(run, forward, (m, x), (m, x))


def test_dropout_p_read_in_training(backend: str) -> None:
    """Dropout.p, read by torch's own Dropout.forward, is a Python value like any other: in
    training, p changed from the captured 0.0 to 0.5 is refused. Before: off by 1.7."""
    model, other = Adapter(0), Adapter(1)
    run = build(forward, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, forward, (m, x), (m, x))
    model.drop.p = 0.5
    x = new_x()
    with refused(r"attribute 'p' of module 'drop' is 0\.5, but was 0\.0", model, x):
        run(model, x)
    model.drop.p = 0.0
    x = new_x()
    agree(run, forward, (model, x), (model, x))


def opt_step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def test_requires_grad_with_optimizer_inside_fn(backend: str) -> None:
    """With an optimizer step inside fn, freezing a layer after capture is refused (before:
    the frozen layer kept moving, by 1e-2 per step); otherwise each step matches eager on a
    twin with its own optimizer."""
    model, other = mlp(0), mlp(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    run = build(opt_step, model, opt, new_x(), backend=backend)
    twin, twin_opt = copy.deepcopy((model, opt))
    other_twin, other_twin_opt = copy.deepcopy((other, other_opt))
    for _ in range(3):
        x = new_x()
        agree(run, opt_step, (model, opt, x), (twin, twin_opt, x))
    x = new_x()
    agree(run, opt_step, (other, other_opt, x), (other_twin, other_twin_opt, x))
    model[0].requires_grad_(False)
    x = new_x()
    with refused(
        r"model parameter '0\.weight' has requires_grad=False, but was captured "
        "with requires_grad=True",
        model,
        opt,
        x,
    ):
        run(model, opt, x)
    model[0].requires_grad_(True)
    x = new_x()
    agree(run, opt_step, (model, opt, x), (twin, twin_opt, x))


def test_training_step_under_no_grad_is_refused(backend: str) -> None:
    """A training step called under torch.no_grad() (or inference_mode) is refused. Before: it
    ran and returned a loss where eager raises."""
    model, other = mlp(0), mlp(1)
    twin, other_twin = copy.deepcopy(model), copy.deepcopy(other)
    run = build(train_step, model, new_x(), backend=backend)
    for m, t in ((model, twin), (other, other_twin), (model, twin)):
        x = new_x()
        agree(run, train_step, (m, x), (t, x))
    x = new_x()
    with pytest.raises(RuntimeError, match="does not require grad"), torch.no_grad():
        train_step(copy.deepcopy(model), x)
    with (
        refused(r"fn runs a backward, but this call is under torch\.no_grad\(\)", model, x),
        torch.no_grad(),
    ):
        run(model, x)
    with (
        refused(r"fn runs a backward, but this call is under torch\.no_grad\(\)", other, x),
        torch.inference_mode(),
    ):
        run(other, x)
    x = new_x()
    agree(run, train_step, (model, x), (twin, x))


def plus_ones(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) + torch.ones(2)


class PassThrough(TorchDispatchMode):
    """A dispatch mode that only calls the operator."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


SHIFT = 1.0


class ShiftsRelu(TorchDispatchMode):
    """A dispatch mode of the user's that changes what relu gives, by a global."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out + SHIFT if func is torch.ops.aten.relu.default else out


class Noting(TorchFunctionMode):
    """A torch function mode of the user's that only notes what runs."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def shifted_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with ShiftsRelu():
        return m(x)


def test_a_users_mode_around_precompile_is_refused_and_one_inside_fn_is_in_the_graph() -> None:
    """Around precompile, a mode's operations would be in the graph and, at a call that must
    have it active too, made again; inside fn they are in the graph once, and what the mode's
    code read is checked."""
    model = mlp(0)
    nowhere = type("Nowhere", (Noting,), {"__module__": None})  # a class made at run time
    for mode in (ShiftsRelu(), Noting(), nowhere()):
        name = type(mode).__name__
        with mode, pytest.raises(PrecompileError, match=rf"mode of yours active \(\S*{name}\)"):
            precompile(forward, model, new_x(), backend="eager")
    run = build(shifted_forward, model, new_x(), backend="eager")
    for _ in range(2):
        x = new_x()
        agree(run, shifted_forward, (model, x), (model, x))
    match = r"global 'SHIFT' of module .* is 2\.0, but was 1\.0"
    with refused_while_set(sys.modules[__name__], "SHIFT", 2.0, match, model, x):
        run(model, x)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def deterministic() -> Iterator[None]:
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_ambient_state_must_be_as_at_capture(backend: str) -> None:
    """Autocast (before: float32 where eager gives bfloat16), the default dtype where fn
    builds a tensor from it, deterministic algorithms and an active dispatch mode must be as
    at capture."""
    model, other = mlp(0), mlp(1)
    run = build(plus_ones, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, plus_ones, (m, x), (m, x))
    x = new_x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
        with refused(r"autocast at this call: cpu bfloat16; at capture: none", model, x):
            run(model, x)
    x = new_x()
    with default_dtype(torch.float64):
        assert plus_ones(model, x).dtype == torch.float64
        with refused(
            r"the default dtype at this call: torch\.float64; at capture: "
            r"torch\.float32",
            model,
            x,
        ):
            run(model, x)
    x = new_x()
    with (
        deterministic(),
        refused(
            r"deterministic algorithms at this call: True; at capture: "
            "False",
            other,
            x,
        ),
    ):
        run(other, x)
    x = new_x()
    with (
        PassThrough(),
        refused(
            r"active torch function and dispatch modes at this call: "
            r"\S*PassThrough; at capture: none",
            other,
            x,
        ),
    ):
        run(other, x)
    for m in (model, other):
        x = new_x()
        agree(run, plus_ones, (m, x), (m, x))


def test_default_dtype_unused_by_fn_does_not_matter(backend: str) -> None:
    """Where fn builds no tensor from the default dtype, another default dtype changes
    nothing eager computes on float32 inputs: the artifact runs and matches."""
    model, other = mlp(0), mlp(1)
    run = build(forward, model, new_x(), backend=backend)
    with default_dtype(torch.float64):
        for m in (model, other, model):
            x = new_x()
            agree(run, forward, (m, x), (m, x))
    x = new_x()
    agree(run, forward, (other, x), (other, x))


def scale_x_read_y(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return m(y)


def test_written_input_aliasing_another_is_refused(backend: str) -> None:
    """fn writes x in place and reads y: one tensor as both is refused at a call, x left
    unchanged (before: off by 0.46-0.58 on inductor), and at capture."""
    model, other = mlp(0), mlp(1)
    run = build(scale_x_read_y, model, new_x(), new_x(), backend=backend)
    for m in (model, other, model):
        x, y = new_x(), new_x()
        agree(run, scale_x_read_y, (m, x, y), (m, x.clone(), y.clone()))
    t = new_x()
    with refused(
        r"input x shares memory with input y at this call, and the artifact writes "
        "the first in place",
        model,
        t,
    ):
        run(model, t, t)
    with refused(
        r"fn writes input x in place, and it shares memory with input y in the "
        "example",
        model,
        t,
    ):
        precompile(scale_x_read_y, model, t, t, backend=backend)
    x, y = new_x(), new_x()
    agree(run, scale_x_read_y, (other, x, y), (other, x.clone(), y.clone()))


def test_written_input_sharing_a_parameter_or_its_elements_is_refused(backend: str) -> None:
    """fn writes x in place, then runs the model: x one with a weight (its .data, or the
    parameter itself under no_grad) is refused, since eager's model would see the write
    (before: the unwritten weight's result, no word); an expanded x is refused by name where
    eager's in-place write fails (before: torch's own error from inside the graph)."""
    model = mlp(0)
    weight = model[0].weight  # (8, 4): x of its shape
    run = build(scale_x_read_y, model, torch.randn(8, 4), new_x(), backend=backend)
    for alias in (weight.data, weight):
        with (
            torch.no_grad(),
            refused(r"input x shares memory with model parameter '0.weight' at this call", model),
        ):
            run(model, alias, new_x())
    expanded = torch.randn(1, 4).expand(8, 4)
    layout = "several of its elements" if backend == "eager" else "kernels assume strides"
    with refused(rf"input x(: the compiled| is written in place).*{layout}", model):
        run(model, expanded, new_x())
    with pytest.raises(RuntimeError, match="more than one element"):  # as eager fails
        scale_x_read_y(model, expanded, new_x())
    x, y = torch.randn(8, 4), new_x()
    agree(run, scale_x_read_y, (model, x, y), (model, x.clone(), y.clone()))


def add_both(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return m(x) + m(y)


@pytest.mark.lowering
def test_same_tensor_twice_without_writes(backend: str) -> None:
    """Without an in-place write, one tensor passed as two inputs computes what eager does."""
    model, other = mlp(0), mlp(1)
    run = build(add_both, model, new_x(), new_x(), backend=backend)
    for m in (model, other, model):
        t = new_x()
        agree(run, add_both, (m, t, t), (m, t, t))
    x, y = new_x(), new_x()
    agree(run, add_both, (other, x, y), (other, x, y))


class CumulativeMean(nn.Module):
    """Keeps a cumulative mean of its outputs in a buffer, as BatchNorm with momentum=None
    does: the factor 1 / steps is read into Python at every call."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.steps.add_(1)
        factor = 1.0 / float(self.steps)
        self.mean.mul_(1 - factor).add_(h.detach().mean(0), alpha=factor)
        return h


def test_refused_call_leaves_every_tensor_as_it_was(backend: str) -> None:
    """BatchNorm1d(momentum=None) in training is refused at capture. The same pattern in a
    module of one's own (a cumulative mean over a step count read into Python): the first
    call matches eager, the second is refused with the buffers, parameters, .grad and input
    exactly as before it."""
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with refused(r"module '1' of m is a BatchNorm1d with momentum=None", bn):
        precompile(train_step, bn, new_x(), backend=backend)
    model, other = CumulativeMean(0), CumulativeMean(1)
    twin, other_twin = copy.deepcopy(model), copy.deepcopy(other)
    run = build(train_step, model, new_x(), backend=backend)
    x = new_x()
    agree(run, train_step, (model, x), (twin, x))
    for _ in range(2):
        x = new_x()
        with refused(
            r"this call left the path the artifact was captured on: a tensor value "
            r"read into Python .* was 1 at capture and is 2 now",
            model,
            x,
        ):
            run(model, x)
    assert int(model.steps) == 1
    x = new_x()
    agree(run, train_step, (other, x), (other_twin, x))
    for m in (model, twin):
        m.steps.zero_()
    x = new_x()
    agree(run, train_step, (model, x), (twin, x))


class ScaledMLP(nn.Sequential):
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        super().__init__(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.scaling = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scaling


def test_changes_after_a_passing_call_are_seen(backend: str) -> None:
    """The driver remembers a model that passed; a hook, an attribute, a submodule's class,
    requires_grad, a tensor hook, a process-wide hook or the training mode changed between two
    calls with the same model object is refused at the next call."""
    model, other = ScaledMLP(0), ScaledMLP(1)
    twin, other_twin = copy.deepcopy(model), copy.deepcopy(other)
    run = build(train_step, model, new_x(), backend=backend)

    def passes(m: nn.Module = model, t: nn.Module = twin) -> None:
        for _ in range(2):  # the second call takes the remembered path
            x = new_x()
            agree(run, train_step, (m, x), (t, x))

    def refuses(match: str, m: nn.Module = model) -> None:
        x = new_x()
        with refused(match, m, x):
            run(m, x)

    passes()
    passes(other, other_twin)
    handle = model[0].register_forward_hook(double_output)
    refuses(r"module '0' has hooks forward: \S*double_output, but had none")
    handle.remove()
    passes()
    model.scaling = 2.0
    refuses(r"attribute 'scaling' of the model is 2\.0, but was 0\.5")
    model.scaling = 0.5
    passes()
    model[1] = nn.Tanh()
    refuses(
        r"module '1' is a torch\.nn\.modules\.activation\.Tanh, but was a "
        r"torch\.nn\.modules\.activation\.ReLU"
    )
    model[1] = nn.ReLU()
    passes()
    model[2].bias.requires_grad_(False)
    refuses(r"model parameter '2\.bias' has requires_grad=False")
    model[2].bias.requires_grad_(True)
    passes()
    handle = model[2].weight.register_hook(triple_grad)
    refuses(r"model parameter '2\.weight' has hooks grad: \S*triple_grad")
    handle.remove()
    passes()
    handle = nn.modules.module.register_module_forward_hook(double_output)
    try:
        refuses(r"the process \(global module hooks")
    finally:
        handle.remove()
    passes()
    model.eval()
    refuses(r"the model is in eval mode, but was captured in training mode")
    model.train()
    passes()
    passes(other, other_twin)
    other.scaling = 1.0
    refuses(r"attribute 'scaling' of the model is 1\.0", other)


def test_class_reassigned_in_place_after_a_passing_call(backend: str) -> None:
    """A submodule whose __class__ is reassigned (no registration, no hook) after a passing
    call is refused like a swapped submodule. Before: the remembered path compared no
    classes, so Tanh ran as the captured ReLU (off by 0.47, no error)."""
    model, other = mlp(0), mlp(1)
    run = build(forward, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        agree(run, forward, (m, x), (m, x))
    model[1].__class__ = nn.Tanh
    x = new_x()
    with refused(
        r"module '1' is a torch\.nn\.modules\.activation\.Tanh, but was a "
        r"torch\.nn\.modules\.activation\.ReLU at capture",
        model,
        x,
    ):
        run(model, x)


@pytest.mark.parametrize("legacy", ["weight_norm", "spectral_norm"])
def test_legacy_weight_norm_is_refused_naming_its_replacement(backend: str, legacy: str) -> None:
    """Before: refused as "fn changed attribute 'weight'", which named neither the hook nor
    what to use instead."""
    model = nn.Sequential(getattr(torch.nn.utils, legacy)(nn.Linear(4, 4)))
    with pytest.raises(PrecompileError, match=rf"{legacy}.*parametrizations\.{legacy}"):
        precompile(lambda m, x: m(x), model, new_x(), backend=backend)
    fixed = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)))
    run = build(lambda m, x: m(x), fixed, new_x(), backend=backend)
    for _ in range(3):
        x = new_x()
        torch.testing.assert_close(run(fixed, x), fixed(x).detach())


@pytest.mark.lowering
@pytest.mark.timeout(900)
def test_transformers_static_cache_wrapper_decodes_as_eager(backend: str) -> None:
    """transformers' TorchExportableModuleWithStaticCache registers its cache tensors as
    buffers, and the model reads them through the cache object. Before: refused as "a tensor
    closed over", which they are not."""
    pytest.importorskip("transformers")
    import logging

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )

    def wrapper(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        model.generation_config = GenerationConfig(
            use_cache=True,
            cache_implementation="static",
            max_length=8,
            cache_config={"batch_size": 1, "max_cache_len": 8, "device": "cpu"},
        )
        return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=8)

    def decode(m: nn.Module, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, cache_position=position)

    captured = wrapper(0)
    run = build(decode, captured, torch.tensor([[3]]), torch.tensor([0]), backend=backend)
    for seed in (0, 1):
        eager, artifact = wrapper(seed), wrapper(seed)
        for step in range(3):
            ids, position = torch.tensor([[5 + step]]), torch.tensor([step])
            torch.testing.assert_close(
                run(artifact, ids, position), decode(eager, ids, position), rtol=1e-4, atol=1e-5
            )
        torch.testing.assert_close(
            dict(artifact.named_buffers()), dict(eager.named_buffers()), rtol=1e-4, atol=1e-5
        )


def seeded_dropout(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(123)
    return nn.functional.dropout(m(x), 0.5, training=True)


@pytest.mark.lowering
def test_a_seed_set_inside_fn_is_set_again_at_every_call(backend: str) -> None:
    """Before: the seed was not replayed, each call drew a new mask (off by 3.3). Now every
    call draws eager's own draws after that seed, on both backends."""
    model, other = mlp(0), mlp(1)
    run = build(seeded_dropout, model, new_x(), backend=backend)
    for m in (model, other, model):
        x = new_x()
        first, second = run(m, x), run(m, x)
        torch.testing.assert_close(first, second)
        torch.testing.assert_close(first, seeded_dropout(m, x).detach())


def test_a_seed_set_after_a_random_draw_is_refused(backend: str) -> None:
    def late(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.dropout(m(x), 0.5, training=True)
        torch.manual_seed(1)
        return y

    with pytest.raises(PrecompileError, match=r"sets the random seed at .*after it drew"):
        precompile(late, mlp(0), new_x(), backend=backend)


def checkpointed_step(m: nn.Module, x: torch.Tensor) -> None:
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    y.pow(2).sum().backward()


def test_checkpointed_dropout_uses_the_forwards_mask() -> None:
    """Before: the backward's recomputation drew a new dropout mask (gradients off by
    4.7e-2). Now the region runs once and the gradients are eager's (eager backend: the same
    draws)."""

    def block(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))

    run = build(checkpointed_step, block(0), new_x(), backend="eager")
    for seed in (0, 1, 0):
        eager, artifact, x = block(seed), block(seed), new_x()
        torch.manual_seed(seed + 10)
        checkpointed_step(eager, x)
        torch.manual_seed(seed + 10)
        run(artifact, x)
        torch.testing.assert_close(
            [p.grad for p in artifact.parameters()], [p.grad for p in eager.parameters()]
        )


def test_the_remembered_check_reads_any_attribute_name() -> None:
    """The generated check of remembered models reads a name that is no Python identifier
    with getattr, and fails (so the call walks the models) when the value changes."""
    from torch_precompile.shipped.driver.rechecks import _CheckSource

    model = nn.Linear(2, 2)
    model.options = type("Options", (), {})()
    setattr(model.options, "class", 3)
    check = _CheckSource([model])
    check.same(check.read(model, ("options", "class")), 3)
    unchanged = check.compiled()
    assert unchanged(model)
    setattr(model.options, "class", 4)
    assert not unchanged(model)
    del model.options
    assert not unchanged(model)


ACTIVATION = torch.relu


class Activated(nn.Module):
    """Computes with callables it holds: a builtin, a partial, a method, a global."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.act = torch.sigmoid
        self.post = functools.partial(torch.clamp, min=0.25)

    def scale(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.scale(ACTIVATION(self.act(self.lin(x)))))


def halve(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y / 2


def test_callables_the_model_and_globals_hold_are_checked(backend: str) -> None:
    """A builtin (``torch.sigmoid``), a partial with plain values, a method of the user's class
    and a global function are part of what the graph computed. Before (0.15.0): each swapped
    after capture (``self.act = torch.tanh``, a new partial, a method patched into the class
    or set on the instance, the global rebound), the artifact computed with the old one."""
    model = Activated()
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    agree(run, forward, (model, x), (model, x))
    changes: list[tuple[Any, str, Any, str]] = [
        (model, "act", torch.tanh, r"'act' of the model is torch\..*tanh, but was .*sigmoid"),
        (model, "post", functools.partial(torch.clamp, min=0.5), r"min=0\.5\), but was"),
        (Activated, "scale", halve, r"'scale' of the model is .*\.halve, but was .*scale"),
        (model, "scale", halve.__get__(model), r"'scale' of the model is .*\.halve, but"),
        (sys.modules[__name__], "ACTIVATION", torch.tanh, r"global 'ACTIVATION' of module"),
    ]
    for owner, name, value, match in changes:
        had = name in vars(owner)
        with refused_while_set(owner, name, value, match, model, x):
            run(model, x)
        if not had:
            delattr(owner, name)
        agree(run, forward, (model, x), (model, x))


def test_the_remembered_check_follows_a_method_to_its_function() -> None:
    """A method is a new bound object at every read: the remembered check compares the
    function behind it, so an unchanged model passes and a patched method fails."""
    from torch_precompile.shipped.driver.rechecks import _CheckSource

    model = Activated()
    check = _CheckSource([model])
    check.same(check.read(model, ("scale",)), model.scale)
    unchanged = check.compiled()
    assert unchanged(model) and unchanged(model)
    model.scale = halve.__get__(model)  # type: ignore[method-assign]
    assert not unchanged(model)


class Scaled(nn.Module):
    """Reads a class attribute (``factor``) through ``self``."""

    factor = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.factor


def test_a_class_attribute_read_through_self_is_checked(backend: str) -> None:
    """A value of the model's class (``factor = 2.0`` in the class body) is baked like an
    instance attribute. Before (0.13.0): changed after capture, the artifact scaled by the
    old value with no error."""
    model = Scaled()
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    with refused_while_set(Scaled, "factor", 5.0, r"'factor' of the model is 5\.0, but was 2", x):
        run(model, x)
    model.factor = 3.0  # an instance attribute now shadows the class's
    with refused(r"attribute 'factor' of the model is 3\.0, but was 2\.0", model, x):
        run(model, x)
    del model.factor
    agree(run, forward, (model, x), (model, x))


class Settings:
    def __init__(self) -> None:
        self.scale = 2.0


SETTINGS = Settings()  # a plain object global: fn reads SETTINGS.scale
SETTINGS_MODULE: Any = None  # a module of the user's, imported by the test: SETTINGS_MODULE.SCALE


def read_settings(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * SETTINGS.scale + SETTINGS_MODULE.SCALE


def test_attributes_of_a_global_object_or_module_are_checked(
    backend: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``config.SCALE`` where ``config`` is a global module or object of the user's: the value
    is baked, so a call must find the same one. Before (0.13.0): changed after capture, the
    artifact used the old value with no error."""
    global SETTINGS_MODULE
    (tmp_path / "user_settings.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_settings  # type: ignore[import-not-found]

    SETTINGS_MODULE = user_settings
    model = mlp(0)
    code, cache = precompile(read_settings, model, new_x(), backend=backend)
    assert "# the globals the trace read: SETTINGS.scale, SETTINGS_MODULE.SCALE" in code
    run = precompile.load(code, cache)
    x = new_x()
    agree(run, read_settings, (model, x), (model, x))
    with refused_while_set(SETTINGS, "scale", 4.0, r"'SETTINGS\.scale' .* is 4\.0, but was 2", x):
        run(model, x)
    agree(run, read_settings, (model, x), (model, x))
    match = r"global 'SETTINGS_MODULE\.SCALE' of module .* is -1\.0, but was 1\.0"
    with refused_while_set(user_settings, "SCALE", -1.0, match, model, x):
        run(model, x)
    agree(run, read_settings, (model, x), (model, x))


def patched_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(self.lin(x))


def test_a_forward_set_on_an_instance_or_patched_into_a_class_is_refused(backend: str) -> None:
    """The artifact runs the forward the trace ran. Before (0.13.0): a forward set on a
    submodule after capture (as wrappers that patch ``module.forward`` do), or patched into its
    class, was never run, with no error."""
    model = nn.Sequential(Scaled(), nn.ReLU())
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    inner = model[0].forward
    model[0].forward = lambda x: inner(x) + 1
    with refused(r"module '0' runs the forward .*<lambda>, but ran its class's own forward", x):
        run(model, x)
    del model[0].forward
    agree(run, forward, (model, x), (model, x))
    match = r"module '0' runs the forward .*\.patched_forward, but ran its class's"
    with refused_while_set(Scaled, "forward", patched_forward, match, x):
        run(model, x)
    agree(run, forward, (model, x), (model, x))


def test_a_forward_set_before_capture_is_the_one_checked(backend: str) -> None:
    """A forward set on the instance before capture is recorded by name: the artifact runs it
    while it is there, and refuses once the class's own is back."""
    model = Scaled()
    model.forward = functools.partial(patched_forward, model)  # type: ignore[method-assign]
    run = build(forward, model, new_x(), backend=backend)
    for _ in range(2):
        x = new_x()
        agree(run, forward, (model, x), (model, x))
    del model.forward
    with refused(r"the model runs its class's own forward, but ran the forward .*patched_forward"):
        run(model, new_x())


def optional_bias(m: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return m(x) if bias is None else m(x) + bias


def test_none_is_an_input_value(backend: str) -> None:
    """An optional input left as None (``mask=None``) is a Python value like any other: baked,
    and a call must pass None there. Before (0.13.0): refused at capture."""
    model = mlp(0)
    run = build(optional_bias, model, new_x(), None, backend=backend)
    x = new_x()
    assert_same(run(model, x, None), optional_bias(model, x, None))
    with refused(r"input bias: expected the value None, got Tensor\.", x):
        run(model, x, torch.ones(2))


CRITERION = nn.CrossEntropyLoss()  # a module held in a global, not passed to fn


def criterion_step(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return CRITERION(m(x), t)


def test_options_of_a_module_held_in_a_global_are_checked(backend: str) -> None:
    """A loss module held in a global reads its options (``label_smoothing``) in forward:
    they are baked like the model's. Before (0.13.0): changed after capture, the artifact
    computed the old loss with no error."""
    model, t = mlp(0), torch.tensor([0, 1, 1])
    run = build(criterion_step, model, new_x(), t, backend=backend)
    x = new_x()
    agree(run, criterion_step, (model, x, t), (model, x, t))
    match = r"global 'CRITERION\.label_smoothing' .* is 0\.3, but was 0\.0"
    with refused_while_set(CRITERION, "label_smoothing", 0.3, match, model, x):
        run(model, x, t)
    agree(run, criterion_step, (model, x, t), (model, x, t))


class Splitter(nn.Module):
    """Splits by a list attribute (``sizes``), as configs hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sizes = [1, 3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, rest = torch.split(self.lin(x), self.sizes, dim=-1)
        return first.sum(-1) + rest.sum(-1) * 2


def test_a_list_attribute_changed_in_place_is_refused(backend: str) -> None:
    """A list read in forward is baked by value. Before (0.13.0): changed in place after a
    passing call, the artifact split as at capture with no error."""
    model = Splitter()
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    model.sizes[0] = 2
    model.sizes[1] = 2
    with refused(r"attribute 'sizes' of the model is \[2, 2\], but was \[1, 3\]", model, x):
        run(model, x)
    model.sizes[:] = [1, 3]
    agree(run, forward, (model, x), (model, x))


def python_random_scale(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * random.random()


def numpy_random_scale(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    numpy = sys.modules["numpy"]
    return m(x) * float(numpy.random.rand())


class OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand(x.shape[0], 2, generator=self.gen)


def test_draws_a_trace_would_bake_are_refused_at_capture(backend: str) -> None:
    """A number drawn from Python's or NumPy's global generator, or from a generator of fn's
    own, would be the same at every call. Before (0.13.0): Python's and NumPy's draws were
    baked with no error, and a module's own generator failed at the first call with a
    NameError."""
    pytest.importorskip("numpy")
    for fn, match in (
        (python_random_scale, r"fn drew from Python's random module"),
        (numpy_random_scale, r"fn drew from NumPy's global random generator"),
    ):
        model = mlp(0)
        with refused(match + r".*Draw with torch \(torch\.rand", model):
            precompile(fn, model, new_x(), backend=backend)
    model = OwnGenerator()
    with refused(r"fn draws random numbers from a torch\.Generator of its own", model):
        precompile(forward, model, new_x(), backend=backend)
    with refused(r"input gen is a torch\.Generator"):
        precompile(
            lambda m, x, gen: m(x) + torch.rand(3, 2, generator=gen),
            mlp(0),
            new_x(),
            torch.Generator(),
            backend=backend,
        )


class OwnPythonGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.rng = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.rng.uniform(0.5, 1.5)


def scaled_by(draw: Callable[[float, float], float]) -> Callable[..., torch.Tensor]:
    def scaled(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * float(draw(0.5, 1.5))

    return scaled


def test_generator_objects_outside_torch_are_refused_at_capture(backend: str) -> None:
    """A random.Random, NumPy Generator or RandomState object that exists before the capture
    draws anew at every eager call; the graph would repeat the capture's number. One that fn
    makes afresh at every call draws the same numbers every time, as the graph does. Before
    (0.15.0): all were baked with no error."""
    numpy = pytest.importorskip("numpy")
    held = {
        "random.Random": random.Random(1),
        "NumPy Generator": numpy.random.default_rng(1),
        "NumPy RandomState": numpy.random.RandomState(1),
    }
    for kind, generator in held.items():
        with refused(rf"fn drew from a {kind} object.*pass the numbers in"):
            precompile(scaled_by(generator.uniform), mlp(0), new_x(), backend=backend)
    with refused(r"fn drew from a random\.Random object \(test_trace_facts\.py"):
        precompile(forward, OwnPythonGenerator(), new_x(), backend=backend)

    def fresh(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * random.Random(7).uniform(0.5, 1.5)

    model = mlp(0)
    run = build(fresh, model, new_x(), backend=backend)
    x = new_x()
    agree(run, fresh, (model, x), (model, x))


def input_saliency(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x.requires_grad_()
    (grad,) = torch.autograd.grad(m(x).sum(), x)
    return grad


def test_an_input_flag_fn_sets_is_refused_at_capture(backend: str) -> None:
    """``x.requires_grad_()`` inside fn leaves eager's x requiring grad; an artifact leaves the
    tensor passed in as it was. Before (0.15.0): the result was right but x came back without
    the flag, with no word. Set before the capture, the flag is an input fact like any."""
    model, x = mlp(0), new_x()
    with refused(r"fn sets requires_grad=True on input x .*x\.requires_grad_\(True\)", x):
        precompile(input_saliency, model, x, backend=backend)
    assert not x.requires_grad

    def saliency(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(m(x).sum(), x)
        return grad

    run = build(saliency, model, new_x().requires_grad_(), backend=backend)
    x = new_x().requires_grad_()
    assert_same(run(model, x), saliency(model, x))


def test_an_input_reshaped_in_place_is_refused_for_inductor() -> None:
    """Inductor compiles for the layout the trace ends with: ``x.t_()`` inside fn made every
    call fail on the layout check, with a message about the caller's strides. Before
    (0.15.0): capture passed and each call was refused. The eager backend replays it."""
    model, x = mlp(0), new_x()

    def transposed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x.t_().t())

    with refused(r"fn changes the shape or layout of input x in place", x):
        precompile(transposed, model, x, backend="inductor")
    assert x.shape == (3, 4)
    run = build(transposed, model, new_x(), backend="eager")
    x = new_x()
    twin = x.clone()
    assert_same(run(model, x), transposed(model, twin))
    assert x.shape == twin.shape == (4, 3)


def forked_noise(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        fixed = torch.rand(x.shape[0], 2)
    return m(x) + fixed + torch.rand(x.shape[0], 2)


def restored_noise(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state = torch.get_rng_state()
    y = m(x) + torch.rand(x.shape[0], 2)
    torch.set_rng_state(state)
    return y + torch.rand(x.shape[0], 2)


def seed_scaled(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * (torch.initial_seed() % 7)


@pytest.mark.parametrize(
    ("fn", "use"),
    [
        (forked_noise, r"torch\.get_rng_state at test_trace_facts\.py:\d+ \(forked_noise\)"),
        (restored_noise, r"torch\.get_rng_state at test_trace_facts\.py:\d+ \(restored_noise\)"),
        (seed_scaled, r"torch\.initial_seed at test_trace_facts\.py:\d+ \(seed_scaled\)"),
    ],
    ids=["fork_rng", "get_set_rng_state", "initial_seed"],
)
def test_a_generator_state_fn_uses_is_refused_at_capture(
    backend: str, fn: Callable[..., Any], use: str
) -> None:
    """Before (0.14.0): the artifact drew on from the caller's state where eager restored its
    own (fork_rng, set_rng_state), or held the capture's initial_seed: other numbers, with no
    error."""
    with pytest.raises(PrecompileError, match=rf"fn uses the random generator's state \({use}\)"):
        precompile(fn, mlp(0), new_x(), backend=backend)


def noisy(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) + torch.rand(x.shape[0], 2) + torch.randn_like(x)[:, :2]


@pytest.mark.lowering
def test_torch_random_ops_draw_anew_at_every_call(backend: str) -> None:
    """torch.rand and its kin draw at every call, as eager does: after the same seed, the
    same numbers, and the generator left where eager leaves it. Before (0.13.0) the inductor
    backend refused them; 0.14.0 drew Inductor's own numbers, not eager's."""
    model = mlp(0)
    run = build(noisy, model, new_x(), backend=backend)
    x = new_x()
    torch.manual_seed(5)
    first = run(model, x)
    second = run(model, x)
    after = torch.rand(2)
    assert not torch.equal(first, second)
    torch.manual_seed(5)
    torch.testing.assert_close(first, noisy(model, x))
    noisy(model, x)
    assert torch.equal(after, torch.rand(2))


LENGTHS = [1, 3]  # a global list: fn splits by it


def split_by_global(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    first, rest = torch.split(m(x), LENGTHS, dim=-1)
    return first.sum(-1) + rest.sum(-1) * 2


def test_a_global_list_changed_in_place_is_refused(backend: str) -> None:
    """A global list is compared by value at every call, not by identity: one changed in place
    after a passing call is refused. Before (0.13.0): a list was not recorded at all."""
    model = nn.Linear(4, 4)
    run = build(split_by_global, model, new_x(), backend=backend)
    x = new_x()
    agree(run, split_by_global, (model, x), (model, x))
    LENGTHS[:] = [2, 2]
    try:
        with refused(r"global 'LENGTHS' of module .* is \[2, 2\], but was \[1, 3\]", model, x):
            run(model, x)
    finally:
        LENGTHS[:] = [1, 3]
    agree(run, split_by_global, (model, x), (model, x))


@dataclasses.dataclass
class BlockConfig:
    """A config object of the user's, as model code holds them."""

    scale: float = 2.0
    sizes: list[list[int]] = dataclasses.field(default_factory=lambda: [[1, 3]])


def _scaled(y: torch.Tensor, config: Any) -> torch.Tensor:
    return y * config.scale


class Configured(nn.Module):
    """Reads its options through locals and helpers (``c = self.options``), where the
    attribute path ends before the value: a dict and a config object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.options = {"shift": 1.0, "sizes": [1, 3]}
        self.config = BlockConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        options = self.options
        first, rest = torch.split(self.lin(x) + options["shift"], options["sizes"], dim=-1)
        return _scaled(first.sum(-1) + rest.sum(-1), self.config)


def test_a_dict_or_object_read_whole_off_a_module_is_checked(backend: str) -> None:
    """Before (0.14.0): a dict attribute, or a config object passed on whole, changed after
    capture (even in place, in a list it holds) gave the capture's numbers with no error."""
    model = Configured()
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    model.options["shift"] = 2.0
    with refused(r"attribute 'options' of the model is \{'shift': 2\.0, 's", model, x):
        run(model, x)
    model.options["shift"] = 1.0
    model.options["sizes"][0] = 2
    with refused(r"'sizes': \[2, 3\]\}, but was \{'shift': 1\.0, 'sizes': \[1, 3\]\}", model, x):
        run(model, x)
    model.options["sizes"][0] = 1
    with refused_while_set(model.config, "scale", 3.0, r"'config\.scale' .* is 3\.0", model, x):
        run(model, x)
    model.config.sizes[0][0] = 5  # held by the config, not read by the trace: checked too
    with refused(r"'config\.sizes' of the model is \[\[5, 3\]\]", model, x):
        run(model, x)
    model.config.sizes[0][0] = 1
    agree(run, forward, (model, x), (model, x))


OPTIONS = {"scale": 2.0}  # a global dict: fn reads OPTIONS["scale"]
GLOBAL_CONFIG = BlockConfig()  # a global object fn hands on whole


def global_options(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _scaled(m(x) * OPTIONS["scale"], GLOBAL_CONFIG)


def test_a_global_dict_or_object_read_whole_is_checked(backend: str) -> None:
    """Before (0.14.0): a global dict was not recorded, and an object handed on whole was
    not followed; either changed after capture gave the capture's numbers."""
    model = nn.Linear(4, 4)
    run = build(global_options, model, new_x(), backend=backend)
    x = new_x()
    agree(run, global_options, (model, x), (model, x))
    OPTIONS["scale"] = 3.0
    try:
        with refused(r"global 'OPTIONS' .* is \{'scale': 3\.0\}, but was \{'scale': 2\.0\}", x):
            run(model, x)
    finally:
        OPTIONS["scale"] = 2.0
    with refused_while_set(GLOBAL_CONFIG, "scale", 4.0, r"'GLOBAL_CONFIG\.scale' .* is 4", x):
        run(model, x)
    agree(run, global_options, (model, x), (model, x))


class ScaleHook:
    """A callable hook object holding its setting."""

    def __init__(self) -> None:
        self.k = 1.0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * self.k


def scale_output(module: nn.Module, args: Any, output: torch.Tensor, k: float) -> torch.Tensor:
    return output * k


def hooked(kind: str) -> tuple[nn.Module, Callable[[float], None], str]:
    """A model with a forward hook holding ``k`` as ``kind`` says, a setter of ``k``, and how
    the hook reads in a message."""
    model = mlp(0)
    if kind == "closure":
        box = {"k": 1.0}
        model[0].register_forward_hook(lambda m, args, out: out * box["k"])
        return model, functools.partial(box.__setitem__, "k"), r"<lambda> box=\{'k': 3\.0\}"
    if kind == "object":
        hook = ScaleHook()
        model[0].register_forward_hook(hook)
        return model, functools.partial(setattr, hook, "k"), r"ScaleHook k=3\.0"
    if kind == "closure-object":  # a callable object of the user's the hook closes over
        scaler = ScaleHook()
        model[0].register_forward_hook(lambda m, args, out: scaler(m, args, out))
        return (
            model,
            functools.partial(setattr, scaler, "k"),
            r"<lambda> scaler=ScaleHook\(k=3\.0\)",
        )
    partial = functools.partial(scale_output, k=1.0)
    model[0].register_forward_hook(partial)
    return model, functools.partial(partial.keywords.__setitem__, "k"), r"scale_output k=3\.0"


@pytest.mark.parametrize("kind", ["closure", "object", "partial", "closure-object"])
def test_a_value_a_hook_holds_is_checked(backend: str, kind: str) -> None:
    """Before (0.14.0): a hook's closure value, a callable hook's attribute or a partial's
    keyword changed after capture gave the capture's numbers with no error; until 0.16.0, so
    did an attribute of a callable object of the user's that a hook closes over."""
    model, set_k, shown = hooked(kind)
    run = build(forward, model, new_x(), backend=backend)
    x = new_x()
    agree(run, forward, (model, x), (model, x))  # the next call takes the remembered path
    set_k(3.0)
    with refused(rf"module '0' has hooks forward: .*{shown}, but had .*1\.0", model, x):
        run(model, x)
    set_k(1.0)
    agree(run, forward, (model, x), (model, x))


def scaled_step(scale: float, act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return act(m(x)) * scale

    return step


def test_values_fn_closes_over_are_named_at_capture(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No call can reach fn's closure to check it, so capture says which plain values the
    graph holds from it (a helper function it closes over is code, not a value)."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(scaled_step(2.0, torch.relu), mlp(0), new_x(), backend=backend)
        precompile(forward, mlp(0), new_x(), backend=backend)
    said = [r.getMessage() for r in caplog.records if "closes over" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("fn reads values it closes over: scale=2.0 (test_trace_facts.py:")
    assert "act=" not in said[0] and "pass a value that may change as an argument" in said[0]


SCALED_STEP = scaled_step(2.0, torch.relu)  # fn held in a global: a call finds its closure


def test_values_fn_closes_over_are_checked_where_a_global_holds_fn(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a global of its module holds fn, every call reads fn's closure through it.
    Before: a closure value changed after capture (a nonlocal assignment, fn made again with
    another value) gave the capture's numbers, named only in a warning at capture."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = build(SCALED_STEP, mlp(0), new_x(), backend=backend)
    assert "closes over" not in caplog.text
    model, x = mlp(0), new_x()
    agree(run, SCALED_STEP, (model, x), (model, x))
    cell = SCALED_STEP.__closure__[SCALED_STEP.__code__.co_freevars.index("scale")]
    cell.cell_contents = 3.0
    said = r"closure variable 'scale' of SCALED_STEP \(module test_trace_facts\) is 3\.0, but"
    with refused(said, model, x):
        run(model, x)
    cell.cell_contents = 2.0
    step = SCALED_STEP
    globals()["SCALED_STEP"] = scaled_step(4.0, torch.relu)
    try:
        with refused("closure variable 'scale' of SCALED_STEP .* is 4.0", model, x):
            run(model, x)
    finally:
        globals()["SCALED_STEP"] = step
    agree(run, SCALED_STEP, (model, x), (model, x))


def multiplier(k: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def multiply(y: torch.Tensor) -> torch.Tensor:
        return y * k

    return multiply


HALVE = multiplier(0.5)  # a helper held in a global: read by its code and closure values


def halved(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return HALVE(m(x))


def test_a_helpers_closure_read_through_a_global_is_checked_not_named(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A helper fn calls through a global is compared by its code and the plain values it
    closes over, so capture names none of them (before: named as if out of reach)."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = build(halved, mlp(0), new_x(), backend=backend)
    assert "closes over" not in caplog.text
    model, x = mlp(0), new_x()
    agree(run, halved, (model, x), (model, x))
    HALVE.__closure__[0].cell_contents = 0.25
    try:
        with refused(r"global 'HALVE' of module test_trace_facts is .*multiply, but was", model, x):
            run(model, x)
    finally:
        HALVE.__closure__[0].cell_contents = 0.5
    agree(run, halved, (model, x), (model, x))


class WithActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = mlp(0)
        self.act = multiplier(0.5)  # a nested function as a module attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_a_closure_cell_of_a_module_attribute_set_anew_is_refused_after_passing_calls(
    backend: str,
) -> None:
    """Before: once calls had passed, the remembered check found the same function object
    and took it, so a cell set anew in place gave the capture's result."""
    model, x = WithActivation(), new_x()
    run = build(forward, model, new_x(), backend=backend)
    for _ in range(2):  # the second call takes the remembered path
        agree(run, forward, (model, x), (model, x))
    model.act.__closure__[0].cell_contents = 0.25
    with refused(r"attribute 'act' of the model is .*multiply, but was", model, x):
        run(model, x)
    model.act.__closure__[0].cell_contents = 0.5
    agree(run, forward, (model, x), (model, x))


class ScaledTrainer:
    """A trainer whose bound step (or the object itself, called) reads a setting off self."""

    def __init__(self) -> None:
        self.scale = 2.0

    def step(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * self.scale

    __call__ = step


class Setting:
    def __init__(self, scale: float) -> None:
        self.scale = scale


def gain_of(setting: Setting) -> Callable[[torch.Tensor], torch.Tensor]:
    def apply(y: torch.Tensor) -> torch.Tensor:
        return y * setting.scale

    return apply


GAINED = gain_of(Setting(3.0))  # a helper held in a global, closing over an object


def gained(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return GAINED(m(x))


def test_an_object_a_global_helper_closes_over_is_read_through_that_global(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the helper's object was only named at capture, and its values changed in
    place gave the capture's result."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = build(gained, mlp(0), new_x(), backend=backend)
    assert "closes over" not in caplog.text
    model, x = mlp(0), new_x()
    for _ in range(2):  # the second call takes the remembered path
        agree(run, gained, (model, x), (model, x))
    setting = GAINED.__closure__[0].cell_contents
    said = r"closure variable 'setting\.scale' of GAINED \(module test_trace_facts\) is 5\.0"
    with refused_while_set(setting, "scale", 5.0, said, model, x):
        run(model, x)
    agree(run, gained, (model, x), (model, x))


def step_with_setting(setting: Setting) -> Callable[..., Any]:
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * setting.scale

    return step


def test_values_of_objects_fn_holds_are_named_at_capture(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bound method's or a callable's own object, and an object fn closes over, are out of
    any call's reach like a closure's values (before: nothing was said; a changed
    ``trainer.scale`` gave the capture's result). Capture names what the graph holds."""
    trainer = ScaledTrainer()
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(trainer.step, mlp(0), new_x(), backend=backend)
        precompile(trainer, mlp(0), new_x(), backend=backend)
        precompile(step_with_setting(Setting(3.0)), mlp(0), new_x(), backend=backend)
    said = [r.getMessage() for r in caplog.records if "closes over" in r.getMessage()]
    assert len(said) == 3, said
    held = "fn reads values it closes over or holds (the object it is a method of): "
    assert said[0].startswith(f"{held}ScaledTrainer.scale=2.0 (test_trace_facts.py:"), said
    assert said[1].startswith(f"{held}ScaledTrainer.scale=2.0 (test_trace_facts.py:"), said
    assert said[2].startswith("fn reads values it closes over: setting.scale=3.0 (test_trace"), said


TRAINER = ScaledTrainer()  # held in a global: a call reads its values there


@pytest.mark.parametrize("form", ["bound method", "callable object"])
def test_values_of_an_object_fn_belongs_to_are_checked_where_a_global_holds_it(
    backend: str, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a global of its class's module holds the object, ``self.scale`` is that
    global's ``TRAINER.scale``, checked at every call. Before: named at capture only."""
    fn = TRAINER.step if form == "bound method" else TRAINER
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = build(fn, mlp(0), new_x(), backend=backend)
    assert "closes over" not in caplog.text
    model, x = mlp(0), new_x()
    agree(run, fn, (model, x), (model, x))
    said = r"global 'TRAINER\.scale' of module test_trace_facts is 4\.0, but was 2\.0"
    with refused_while_set(TRAINER, "scale", 4.0, said, model, x):
        run(model, x)
    agree(run, fn, (model, x), (model, x))


def smoothed_step(label_smoothing: float) -> Callable[..., Any]:
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def step(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return criterion(m(x), t)

    return step


def test_options_of_a_loss_fn_closes_over_are_named_at_capture(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loss module in a closure keeps the options it had at capture: capture names them."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(smoothed_step(0.1), mlp(0), new_x(), torch.tensor([0, 1, 1]), backend="eager")
    said = [r.getMessage() for r in caplog.records if "closes over" in r.getMessage()]
    assert len(said) == 1 and "criterion.label_smoothing=0.1 (loss.py:" in said[0], said


def item_step(m: nn.Module, x: torch.Tensor) -> float:
    loss = m(x).pow(2).mean()
    loss.backward()
    return loss.item()


def test_a_returned_item_is_named_at_capture_and_in_the_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``return loss.item()`` makes the number a read the artifact checks: a call with other
    data is refused. Capture says so, and the refusal names the fix (return the tensor)."""
    model = mlp(0)
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = build(item_step, model, new_x(), backend="eager")
    said = [r.getMessage() for r in caplog.records if "returns a number" in r.getMessage()]
    assert len(said) == 1 and "(.item(), at test_trace_facts.py:" in said[0], said
    assert "Return the tensor instead (loss.detach())" in said[0]
    x = new_x()
    with refused(r"a number fn returns, such as loss\.item\(\), is one: return the tensor", model):
        run(model, x)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(train_step, mlp(0), new_x(), backend="eager")
    assert not [r for r in caplog.records if "returns a number" in r.getMessage()]


def timed_step(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    y = m(x)
    return y, time.perf_counter() - start


def test_a_clock_read_is_named_at_capture(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """The graph holds the capture's reading: a duration fn returns is the same at every
    call. Capture says so, naming the clock and the line."""
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(timed_step, mlp(0), new_x(), backend=backend)
    said = [r.getMessage() for r in caplog.records if "reads the clock" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("fn reads the clock: time.perf_counter (test_trace_facts.py:")
    assert "time the call outside fn" in said[0]


STEP_LOG = logging.getLogger("tests.chatty_step")


def chatty_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    print("step starts")
    STEP_LOG.info("in fn")
    y = m(x)
    if y.shape[0] > 100:  # a branch the trace does not take: no call made, none named
        print("a large batch")
    warnings.warn("about to return", stacklevel=1)
    logging.debug("through the root logger")
    return y


def test_print_logging_and_warnings_calls_are_named_at_capture(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A print, logging or warnings.warn call in fn runs once, while fn is traced, and never
    at a call of the artifact: capture names each one the user's code made, with its line,
    in one warning (torch's own warnings, here softmax's, are not named)."""
    lines, first = inspect.getsourcelines(chatty_step)
    at = {
        c: first + next(i for i, line in enumerate(lines) if c in line)
        for c in ("step starts", "STEP_LOG", "warnings.warn", "logging.debug")
    }
    with caplog.at_level(logging.WARNING, logger="torch_precompile"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = build(chatty_step, mlp(0), new_x(), backend="eager")
    said = [r.getMessage() for r in caplog.records if "prints, logs or warns" in r.getMessage()]
    where = "test_trace_facts.py:{} (chatty_step)"
    assert said == [
        f"fn prints, logs or warns: print ({where.format(at['step starts'])}), logging.info "
        f"({where.format(at['STEP_LOG'])}), warnings.warn ({where.format(at['warnings.warn'])}), "
        f"logging.debug ({where.format(at['logging.debug'])}). Each ran once, at capture, and "
        "will not run at a call of the artifact, which runs the graph alone; move it outside "
        "fn, around the artifact's call."
    ], said
    assert "step starts" in capsys.readouterr().out  # it ran, at capture
    model, x = mlp(0), new_x()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert_same(run(model, x), model(x))
    assert capsys.readouterr().out == "" and not warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile(lambda m, x: nn.functional.softmax(m(x)), mlp(0), new_x(), backend="eager")
    assert not [r for r in caplog.records if "prints, logs or warns" in r.getMessage()]


def env_scaled(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    scale = float(os.environ.get("TP_TEST_SCALE", "1"))
    return m(x) * scale + (1.0 if "TP_TEST_FLAG" in os.environ else 0.0)


def test_environment_variables_fn_reads_are_checked(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before (0.14.0): a variable set, changed or unset after capture gave the capture's
    numbers with no error."""
    monkeypatch.setenv("TP_TEST_SCALE", "2")
    monkeypatch.delenv("TP_TEST_FLAG", raising=False)
    model = mlp(0)
    code, cache = precompile(env_scaled, model, new_x(), backend=backend)
    assert "os.environ['TP_TEST_FLAG'], os.environ['TP_TEST_SCALE']" in code
    run = precompile.load(code, cache)
    x = new_x()
    agree(run, env_scaled, (model, x), (model, x))
    agree(run, env_scaled, (model, x), (model, x))  # the globals' settled path is not taken
    monkeypatch.setenv("TP_TEST_SCALE", "3")
    with refused(r"environment variable 'TP_TEST_SCALE' is '3', but was '2'", model, x):
        run(model, x)
    monkeypatch.setenv("TP_TEST_SCALE", "2")
    monkeypatch.setenv("TP_TEST_FLAG", "1")
    with refused(r"environment variable 'TP_TEST_FLAG' is '1', but was None", model, x):
        run(model, x)
    monkeypatch.delenv("TP_TEST_FLAG")
    agree(run, env_scaled, (model, x), (model, x))


def by_grad_mode(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    scale = 3.0 if torch.is_grad_enabled() else 2.0  # a gate like gradient checkpointing's
    return m(x) * scale


def by_threads(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * (2.0 if torch.get_num_threads() > 1 else 1.0)


def grad_mode_inside(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        on = torch.is_grad_enabled()  # fn's own setting: the call's does not matter
    return m(x) * (3.0 if on else 2.0)


def test_a_torch_setting_fn_reads_must_be_as_at_capture() -> None:
    """``torch.is_grad_enabled()`` and ``torch.get_num_threads()`` read into Python decide a
    branch. Before: the trace ran with gradients on whatever the capture's setting, so an
    artifact captured and called under no_grad returned ``m(x) * 3`` where eager gives
    ``m(x) * 2``, and a call in another setting took the capture's branch; now fn is shown
    the capture's setting and a call in another is refused, leaving every tensor as it was."""
    model = mlp(0)
    with torch.no_grad():
        run = build(by_grad_mode, model, new_x(), backend="eager")
        x = new_x()
        agree(run, by_grad_mode, (model, x), (model, x))
    x = new_x()
    with refused(r"torch\.is_grad_enabled\(\) gives True at this call, but gave False", model, x):
        run(model, x)
    on_grad = build(by_grad_mode, model, new_x(), backend="eager")
    x = new_x()
    agree(on_grad, by_grad_mode, (model, x), (model, x))
    with torch.no_grad(), refused(r"torch\.is_grad_enabled\(\) gives False", model, x):
        on_grad(model, x)
    threads = torch.get_num_threads()
    run = build(by_threads, model, new_x(), backend="eager")
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        with refused(rf"torch\.get_num_threads\(\) gives \d+ at this call, but gave {threads}"):
            run(model, new_x())
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():  # fn's own enable_grad decides its read: no check
        run = build(grad_mode_inside, model, new_x(), backend="eager")
    x = new_x()
    agree(run, grad_mode_inside, (model, x), (model, x))


def close_to_zero(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m(x)
    return y * 2 if torch.allclose(x, torch.zeros_like(x), atol=0.5) else y


def test_torch_allclose_deciding_a_branch_is_guarded(backend: str) -> None:
    """Before: the branch ``torch.allclose`` took at capture ran for every input (allclose
    compares in C++, below the trace); now it is a value guard."""
    model = mlp(0)
    x = torch.full((3, 4), 0.1)
    with torch.no_grad():
        run = build(close_to_zero, model, x, backend=backend)
        agree(run, close_to_zero, (model, x), (model, x))
        far = x * 10
        with refused(r"torch\.allclose at .* was True at capture and is False now", model, far):
            run(model, far)


def clipped_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).pow(2).mean()
    loss.backward()
    nn.utils.clip_grad_norm_(m.parameters(), 0.01)  # reads the gradients .grad holds
    return loss.detach()


def zeroed_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m.zero_grad()
    return train_step(m, x)


def test_what_fn_does_with_the_grad_a_call_finds() -> None:
    """Before: a call finding a ``.grad`` (gradients accumulated over micro-batches) got the
    artifact's gradient added to it, also where fn's own ``zero_grad()`` drops it first, and
    ``clip_grad_norm_`` inside fn clipped by the norm of the new gradients alone. Now fn's
    zero_grad() is replayed (the new gradient replaces the old) and a call with a .grad that
    fn would read is refused."""
    model, twin = mlp(0), mlp(0)
    zeroed = build(zeroed_step, model, new_x(), backend="eager")
    clipped = build(clipped_step, model, new_x(), backend="eager")
    for m in (model, twin):
        train_step(m, new_x().fill_(1.0))  # gradients from an earlier micro-batch
    x = new_x()
    agree(zeroed, zeroed_step, (model, x), (twin, x))
    model.zero_grad()
    twin.zero_grad()
    x = new_x()
    agree(clipped, clipped_step, (model, x), (twin, x))
    train_step(model, x)
    with refused(
        r"model parameter '0\.weight' has a \.grad from before the call, and fn reads", model, x
    ):
        clipped(model, x)


def hand_sgd_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad  # a hand-written SGD step
    m.zero_grad()
    return loss.detach()


def moved_towards_one(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        m[2].weight.data.mul_(0.9).add_(0.1)  # an EMA-style update, through .data
    return m(x)


@pytest.mark.lowering
@pytest.mark.parametrize("fn", [hand_sgd_step, moved_towards_one])
def test_parameters_fn_writes_in_place_are_left_alone_by_capture(
    fn: Callable[..., Any], backend: str
) -> None:
    """fn writes parameters in place (a hand-written SGD step, an EMA update). Before: the
    trace ran on the model's own parameters, so capture itself applied the update once and
    every later result was off by that step (0.03 to 0.35); now capture leaves the model as it
    was and the artifact matches eager call after call."""
    model, twin = mlp(0), mlp(0)
    before = snapshot(model)
    run = build(fn, model, new_x(), backend=backend)
    assert_identical(before, snapshot(model))
    for _ in range(2):
        x = new_x()
        agree(run, fn, (model, x), (twin, x))


def data_replacing_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).pow(2).mean()
    loss.backward()
    for p in m.parameters():
        p.data = p.data - 0.1 * p.grad  # replaces the data: no operator records it
    return loss.detach()


def test_replacing_a_parameters_data_is_refused_and_put_back() -> None:
    """``p.data = ...`` inside fn. Before: capture pointed the model's parameters at the
    updated data (off by 0.013 after precompile) and the graph held no update at all; now it
    is refused at capture, naming the parameters, with the model as it was."""
    model = mlp(0)
    before = snapshot(model)
    with pytest.raises(PrecompileError, match=r"fn replaces the data of parameters '0\.weight'"):
        precompile(data_replacing_step, model, new_x(), backend="eager")
    assert_identical(before, snapshot(model))
