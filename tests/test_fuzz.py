"""Fuzzing the runtime call. A call the contract allows (same structure, shapes, dtypes,
devices, Python values, model layout and flags as the example; other values) must be served
and equal eager. Any other call either equals eager or raises PrecompileError having changed
nothing: no parameter, .grad, buffer or input tensor is touched by a refusal. Never another
exception, never a wrong result, never a crash.

CI runs FUZZ_EXAMPLES calls in all (default 2400, spread over the workloads and both
backends); set FUZZ_EXAMPLES=50000 for a long run. The totals are printed at the end.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from torch_precompile import PrecompileError

from workloads import WORKLOADS, TiedLM

FUZZED = ["mlp_infer", "mlp_train", "pytree", "tied", "two_models", "mutate"]
TRAINING = {"mlp_train", "tied", "two_models"}  # their fn runs a backward
TOTAL = int(os.environ.get("FUZZ_EXAMPLES", "2400"))
PER_CASE = max(1, TOTAL // (len(FUZZED) * 2))
OUTCOMES: Counter[str] = Counter()

Mutation = Callable[[tuple[Any, ...], st.DataObject], tuple[Any, ...]]


def _tensor_paths(args: tuple[Any, ...]) -> list[Any]:
    leaves = pytree.tree_flatten_with_path(list(args))[0]
    return [
        path
        for path, leaf in leaves
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, nn.Parameter)
    ]


def _replace_leaf(
    args: tuple[Any, ...], data: st.DataObject, make: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """Replace one input leaf (tensor or Python value) chosen by ``data``."""
    with_paths, spec = pytree.tree_flatten_with_path(list(args))
    candidates = [i for i, (_, leaf) in enumerate(with_paths) if not isinstance(leaf, nn.Module)]
    if not candidates:
        return args
    index = data.draw(st.sampled_from(candidates))
    leaves = [leaf for _, leaf in with_paths]
    leaves[index] = make(leaves[index])
    return tuple(pytree.tree_unflatten(leaves, spec))


def _models(args: tuple[Any, ...]) -> list[nn.Module]:
    return [a for a in args if isinstance(a, nn.Module)]


def reshape_input(args, data):
    def make(leaf):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return torch.randn(data.draw(st.integers(0, 3)))
        shape = list(leaf.shape)
        choice = data.draw(st.sampled_from(["grow", "shrink", "add_dim", "drop_dim"]))
        if choice == "grow":
            shape[data.draw(st.integers(0, len(shape) - 1))] += data.draw(st.integers(1, 3))
        elif choice == "shrink":
            dim = data.draw(st.integers(0, len(shape) - 1))
            shape[dim] = max(0, shape[dim] - data.draw(st.integers(1, 3)))
        elif choice == "add_dim":
            shape.insert(0, data.draw(st.integers(1, 2)))
        else:
            shape = shape[1:]
        if leaf.dtype.is_floating_point:
            return torch.randn(shape, dtype=leaf.dtype, device=leaf.device)
        if leaf.dtype == torch.bool:
            return torch.zeros(shape, dtype=torch.bool, device=leaf.device)
        return torch.randint(0, 5, shape, dtype=leaf.dtype, device=leaf.device)

    return _replace_leaf(args, data, make)


def retype_input(args, data):
    dtype = data.draw(st.sampled_from([torch.float64, torch.float16, torch.int64, torch.bool]))
    return _replace_leaf(
        args, data, lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) else leaf
    )


def move_input(args, data):
    return _replace_leaf(
        args, data, lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf
    )


def relayout_input(args, data):
    def make(leaf):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2 or leaf.is_meta:
            return leaf
        if data.draw(st.booleans()):
            return leaf.transpose(-1, -2).contiguous().transpose(-1, -2)
        wide = torch.zeros(*leaf.shape[:-1], leaf.shape[-1] + 3, dtype=leaf.dtype)
        wide[..., : leaf.shape[-1]] = leaf
        return wide[..., : leaf.shape[-1]]  # same values, padded rows

    return _replace_leaf(args, data, make)


def new_values(args, data):
    """A valid call: same shapes, other values (kept away from ties such as all-equal inputs,
    where eager and compiled kernels may round onto different sides of a ReLU kink)."""

    def make(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
            return torch.randn_like(leaf) * data.draw(st.sampled_from([0.5, 1.0, 10.0]))
        return leaf

    return _replace_leaf(args, data, make)


def replace_python_value(args, data):
    value = data.draw(
        st.one_of(
            st.integers(-3, 3),
            st.floats(allow_nan=True),
            st.text(max_size=3),
            st.none(),
            st.booleans(),
        )
    )
    return _replace_leaf(args, data, lambda leaf: value)


def restructure(args, data):
    choice = data.draw(
        st.sampled_from(["wrap_list", "wrap_dict", "tuple_to_list", "extra_key", "drop_key"])
    )

    def make_container(value):
        if choice == "wrap_list":
            return [value]
        if choice == "wrap_dict":
            return {"x": value}
        if choice == "tuple_to_list" and isinstance(value, tuple):
            return list(value)
        if isinstance(value, dict) and value:
            copied = dict(value)
            if choice == "extra_key":
                copied["extra"] = torch.zeros(1)
            else:
                copied.pop(next(iter(copied)))
            return copied
        return [value]

    positions = [i for i, a in enumerate(args) if not isinstance(a, nn.Module)]
    if not positions:
        return args
    i = data.draw(st.sampled_from(positions))
    return (*args[:i], make_container(args[i]), *args[i + 1 :])


def change_arity(args, data):
    if data.draw(st.booleans()) and args:
        return args[:-1]
    return (*args, torch.zeros(2))


def swap_parameters(args, data):
    """Valid: two same-shaped parameters exchange their tensors."""
    for model in _models(args):
        params = list(model.named_parameters())
        pairs = [
            (a, b)
            for i, a in enumerate(params)
            for b in params[i + 1 :]
            if a[1].shape == b[1].shape and a[1] is not b[1]
        ]
        if pairs:
            (name_a, a), (name_b, b) = data.draw(st.sampled_from(pairs))
            _set(model, name_a, b)
            _set(model, name_b, a)
            break
    return args


def retie_parameters(args, data):
    for model in _models(args):
        params = list(model.named_parameters())
        pairs = [
            (a, b)
            for i, a in enumerate(params)
            for b in params[i + 1 :]
            if a[1].shape == b[1].shape
        ]
        if pairs:
            (name_a, _), (_, b) = data.draw(st.sampled_from(pairs))
            _set(model, name_a, b)
            break
    return args


def untie_parameters(args, data):
    for model in _models(args):
        if isinstance(model, TiedLM):
            model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return args


def resize_parameter(args, data):
    for model in _models(args):
        params = list(model.named_parameters())
        if params:
            name, p = data.draw(st.sampled_from(params))
            shape = [s + 1 for s in p.shape] or [2]
            _set(model, name, nn.Parameter(torch.randn(shape)))
            break
    return args


def freeze_parameter(args, data):
    for model in _models(args):
        params = list(model.parameters())
        if params:
            data.draw(st.sampled_from(params)).requires_grad_(data.draw(st.booleans()))
    return args


def retype_model(args, data):
    dtype = data.draw(st.sampled_from([torch.float64, torch.float16]))
    for model in _models(args):
        model.to(dtype)
    return args


def reorder_model(args, data):
    """Submodules re-registered in another order: names stay, order changes."""
    for model in _models(args):
        children = list(model._modules.items())
        if len(children) > 1:
            for name, _ in children:
                del model._modules[name]
            for name, child in reversed(children):
                model._modules[name] = child
            break
    return args


def other_model(args, data):
    replacement = data.draw(st.sampled_from(["class", "state_dict", "extra_buffer"]))
    positions = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
    if not positions:
        return args
    i = data.draw(st.sampled_from(positions))
    if replacement == "class":
        new: Any = TiedLM() if not isinstance(args[i], TiedLM) else nn.Linear(4, 3)
    elif replacement == "state_dict":
        new = args[i].state_dict()
    else:
        new = args[i]
        new.register_buffer("surprise", torch.zeros(1))
    return (*args[:i], new, *args[i + 1 :])


def _set(model: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner_name, _, attr = dotted.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._parameters[attr] = value if isinstance(value, nn.Parameter) else nn.Parameter(value)


MUTATIONS: list[Mutation] = [
    reshape_input,
    retype_input,
    move_input,
    relayout_input,
    new_values,
    replace_python_value,
    restructure,
    change_arity,
    swap_parameters,
    retie_parameters,
    untie_parameters,
    resize_parameter,
    freeze_parameter,
    retype_model,
    reorder_model,
    other_model,
]


def _observable(args: tuple[Any, ...]) -> list[Any]:
    """What a call can change: parameter .grad fields, buffers, and input tensors."""
    seen: list[Any] = []
    for a in args:
        if isinstance(a, nn.Module):
            seen += [p.grad for p in a.parameters()] + list(a.buffers())
    seen += [
        t
        for t in pytree.tree_leaves([a for a in args if not isinstance(a, nn.Module)])
        if isinstance(t, torch.Tensor)
    ]
    return seen


def _same(actual: Any, expected: Any) -> bool:
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        return False
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
                return False
            if not torch.allclose(
                a.detach().double(), e.detach().double(), rtol=1e-4, atol=1e-4, equal_nan=True
            ):
                return False
        elif not (a == e or (a != a and e != e)):
            return False
    return True


def _signature(args: tuple[Any, ...], backend: str, training: bool) -> Any:
    """What the contract fixes about a call, read off the arguments: arity and nesting; each
    input tensor's shape, dtype and device (for inductor, its strides; for a training step,
    requires_grad); each Python value; each model's parameter and buffer names in order, their
    tying, shapes, dtypes and devices (and the same per-tensor rules), and every submodule's
    training flag. A call with the example's signature is one the artifact must serve."""
    ties: dict[int, int] = {}

    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        strides = tuple(t.stride()) if backend == "inductor" else None
        requires_grad = t.requires_grad if training else None
        return (
            tuple(t.shape),
            t.dtype,
            t.device,
            requires_grad,
            strides,
            ties.setdefault(id(t), len(ties)),
        )

    def leaf(value: Any) -> Any:
        if isinstance(value, nn.Module):
            return (
                "model",
                [(n, tensor(p)) for n, p in value.named_parameters(remove_duplicate=False)],
                [(n, tensor(b)) for n, b in value.named_buffers(remove_duplicate=False)],
                [(n, m.training) for n, m in value.named_modules()],
            )
        if isinstance(value, torch.Tensor):
            return ("tensor", tensor(value))
        return ("value", type(value), value)

    leaves, spec = pytree.tree_flatten(list(args))
    return spec, [leaf(value) for value in leaves]


def _writable(args: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """Every parameter, .grad, buffer and input tensor of a call, named, as the objects."""
    found: list[tuple[str, Any]] = []
    for i, a in enumerate(args):
        if isinstance(a, nn.Module):
            for n, p in a.named_parameters(remove_duplicate=False):
                found += [(f"argument {i} parameter {n}", p), (f"argument {i} {n}.grad", p.grad)]
            found += [
                (f"argument {i} buffer {n}", b) for n, b in a.named_buffers(remove_duplicate=False)
            ]
    leaves = pytree.tree_flatten_with_path(list(args))[0]
    found += [
        (f"input {pytree.keystr(path)}", t) for path, t in leaves if isinstance(t, torch.Tensor)
    ]
    return found


def _snapshot(args: tuple[Any, ...]) -> list[tuple[str, Any, Any]]:
    return [
        (name, obj, obj.detach().clone() if isinstance(obj, torch.Tensor) else None)
        for name, obj in _writable(args)
    ]


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    # contiguous first: a flattened view of a strided tensor may keep a stride that bytes
    # cannot be viewed through
    return None if t.is_meta else t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_untouched(args: tuple[Any, ...], before: list[tuple[str, Any, Any]]) -> None:
    """Each object is still in its place and holds the same bits as before the call."""
    now = _writable(args)
    assert [name for name, _ in now] == [name for name, _, _ in before], "the call moved tensors"
    for (name, obj), (_, old_obj, old_value) in zip(now, before, strict=True):
        assert obj is old_obj, f"a refused call replaced {name}"
        if isinstance(obj, torch.Tensor):
            assert obj.shape == old_value.shape and obj.dtype == old_value.dtype, name
            new_bits, old_bits = _bits(obj), _bits(old_value)
            unchanged = new_bits is None or torch.equal(new_bits, old_bits)
            assert unchanged, f"a refused call changed {name}"


@pytest.mark.parametrize("name", FUZZED)
def test_fuzzed_calls(name: str, backend: str, artifacts) -> None:
    run = artifacts.load(name, backend)
    workload = WORKLOADS[name]
    base = workload.args()
    allowed = _signature(base, backend, name in TRAINING)
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=PER_CASE,
        deadline=None,
        derandomize=TOTAL <= 5000,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(st.data())
    def one_call(data: st.DataObject) -> None:
        args = copy.deepcopy(base)
        # Half the calls change only values (valid calls); the rest may break something.
        if data.draw(st.booleans()):
            args = new_values(swap_parameters(args, data), data)
        for _ in range(data.draw(st.integers(0, 2))):
            args = data.draw(st.sampled_from(MUTATIONS))(args, data)
        must_serve = _signature(args, backend, name in TRAINING) == allowed
        eager_args, compiled_args = copy.deepcopy(args), copy.deepcopy(args)
        before = _snapshot(compiled_args)
        try:
            result = run(*compiled_args)
        except PrecompileError as e:
            assert not must_serve, f"{name}: a call the contract allows was refused: {e}"
            _assert_untouched(compiled_args, before)
            outcomes["refused"] += 1
            return
        # The artifact served the call: eager must agree, on everything it can observe.
        expected = workload.fn(*eager_args)
        assert _same(result, expected), f"wrong result for {name}"
        assert _same(_observable(compiled_args), _observable(eager_args)), (
            f"wrong side effects for {name}"
        )
        outcomes["valid" if must_serve else "served"] += 1

    one_call()
    OUTCOMES.update(outcomes)
    # Each case exercises both sides of the contract: calls that must run and calls refused.
    assert outcomes["valid"] > 0 and outcomes["refused"] > 0, outcomes


@pytest.fixture(scope="module", autouse=True)
def _print_totals() -> Any:
    yield
    total = sum(OUTCOMES.values())
    print(
        f"\nfuzz: {total} calls, {OUTCOMES['valid']} valid calls equal to eager, "
        f"{OUTCOMES['served']} other calls served and equal to eager, "
        f"{OUTCOMES['refused']} refused with PrecompileError, nothing changed"
    )
